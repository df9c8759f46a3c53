"""The converters and `rollout.generate` refuse bad arguments with one line naming their own flags,
before building a model or generating."""
import os

import pytest

import json

import torch

from checkpoint_convert import hf_to_torch_dist, torch_dist_to_hf
from rollout import generate
from tests.trainer_fixtures import make_tiny


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(HF dir with 1 MTP layer, its torch_dist conversion)."""
    hf = str(tmp_path_factory.mktemp("conv_hf"))
    make_tiny(hf, seed=9)
    dist = str(tmp_path_factory.mktemp("conv_root") / "dist")
    hf_to_torch_dist.main(["--hf-checkpoint", hf, "--save", dist, "--mtp-num-layers", "1"])
    return hf, dist


def refusal(capsys, main, argv):
    with pytest.raises(SystemExit) as ex:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert ex.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_hf_to_torch_dist_refuses_mtp_num_layers_0_without_drop_mtp(converted, tmp_path, capsys):
    hf, _ = converted
    line = refusal(capsys, hf_to_torch_dist.main, ["--hf-checkpoint", hf, "--save", str(tmp_path / "o"),
                                                   "--mtp-num-layers", "0"])
    assert "--mtp-num-layers 0" in line and "--drop-mtp" in line


def test_hf_to_torch_dist_refuses_a_non_empty_save_dir_and_the_source_dir(converted, tmp_path, capsys):
    hf, _ = converted
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    line = refusal(capsys, hf_to_torch_dist.main, ["--hf-checkpoint", hf, "--save", str(tmp_path / "full"),
                                                   "--mtp-num-layers", "1"])
    assert "--save" in line and "not empty" in line and "notes.txt" in line
    line = refusal(capsys, hf_to_torch_dist.main, ["--hf-checkpoint", hf, "--save", hf, "--mtp-num-layers", "1"])
    assert "--save" in line and "--hf-checkpoint" in line


def test_converters_refuse_a_read_only_destination(converted, capsys):
    hf, dist = converted
    line = refusal(capsys, hf_to_torch_dist.main, ["--hf-checkpoint", hf, "--save", "/proc/vime_dist",
                                                   "--mtp-num-layers", "1"])
    assert "--save /proc/vime_dist" in line and "cannot write" in line
    line = refusal(capsys, torch_dist_to_hf.main, ["--input-dir", dist, "--output-dir", "/proc/vime_hf",
                                                   "--origin-hf-dir", hf])
    assert "--output-dir /proc/vime_hf" in line and "cannot write" in line


def test_torch_dist_to_hf_refuses_to_overwrite_the_origin_or_mix_into_a_full_dir(converted, tmp_path, capsys):
    hf, dist = converted
    before = sorted(os.listdir(hf)), os.path.getmtime(os.path.join(hf, "model.safetensors"))
    line = refusal(capsys, torch_dist_to_hf.main, ["--input-dir", dist, "--output-dir", hf, "--origin-hf-dir", hf])
    assert "--output-dir" in line and "--origin-hf-dir" in line and "overwrite" in line
    assert (sorted(os.listdir(hf)), os.path.getmtime(os.path.join(hf, "model.safetensors"))) == before
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    line = refusal(capsys, torch_dist_to_hf.main, ["--input-dir", dist, "--output-dir", str(tmp_path / "full"),
                                                   "--origin-hf-dir", hf])
    assert "not empty" in line


def test_torch_dist_to_hf_errors_name_its_own_flags(converted, tmp_path, capsys):
    hf, dist = converted
    line = refusal(capsys, torch_dist_to_hf.main, ["--input-dir", dist, "--output-dir", str(tmp_path / "o"),
                                                   "--origin-hf-dir", str(tmp_path / "nope")])
    assert line.startswith(f"error: --origin-hf-dir {tmp_path / 'nope'}")
    (tmp_path / "noconf").mkdir()
    line = refusal(capsys, torch_dist_to_hf.main, ["--input-dir", dist, "--output-dir", str(tmp_path / "o"),
                                                   "--origin-hf-dir", str(tmp_path / "noconf")])
    assert "--origin-hf-dir" in line and "config.json" in line and "--hf-checkpoint" not in line
    line = refusal(capsys, torch_dist_to_hf.main, ["--input-dir", hf, "--output-dir", str(tmp_path / "o"),
                                                   "--origin-hf-dir", hf])
    assert "--input-dir" in line and "--load" not in line


def prompts_file(tmp_path, *texts):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return str(path)


def test_generate_checks_output_before_generating(small_ckpt, tmp_path, capsys):
    out = tmp_path / "missing" / "out.jsonl"
    line = refusal(capsys, generate.main, ["--hf-checkpoint", small_ckpt, "--prompts", prompts_file(tmp_path, "1+2="),
                                           "--output", str(out), "--max-new-tokens", "4"])
    assert f"--output {out}" in line and "does not exist" in line
    line = refusal(capsys, generate.main, ["--hf-checkpoint", small_ckpt, "--prompts", prompts_file(tmp_path, "1+2="),
                                           "--output", "/proc/vime_out.jsonl", "--max-new-tokens", "4"])
    assert "--output" in line and "cannot write" in line


def test_generate_refuses_unknown_prompt_characters(small_ckpt, tmp_path, capsys):
    line = refusal(capsys, generate.main, ["--hf-checkpoint", small_ckpt, "--prompts",
                                           prompts_file(tmp_path, "1+2=", "一加二"), "--output",
                                           str(tmp_path / "o.jsonl"), "--max-new-tokens", "4"])
    assert "line 2" in line and "not in the model's vocabulary" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a CPU-only torch")
def test_generate_refuses_cuda_on_cpu_torch(small_ckpt, tmp_path, capsys):
    line = refusal(capsys, generate.main, ["--hf-checkpoint", small_ckpt, "--prompts", prompts_file(tmp_path, "1+2="),
                                           "--output", str(tmp_path / "o.jsonl"), "--device", "cuda"])
    assert "--device cuda" in line and "--device cpu" in line


@pytest.mark.parametrize("init_from", ["other-shape", "missing"])
def test_make_tiny_model_refuses_an_init_checkpoint_it_cannot_continue_from(converted, tmp_path, init_from):
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = converted[0] if init_from == "other-shape" else str(tmp_path / "no-such-model")
    proc = subprocess.run([sys.executable, "scripts/make_tiny_model.py", "--out", str(tmp_path / "out"),
                           "--steps", "0", "--init-from", path], cwd=repo, capture_output=True, text=True)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("error: ") and path in err[0], proc.stderr
    assert not os.path.exists(tmp_path / "out")  # refused before anything was written


@pytest.mark.parametrize("script, flag", [("make_eagle3_draft.py", "--target"), ("make_dflash_draft.py", "--target"),
                                          ("strip_mtp.py", "--source")])
def test_tools_name_their_own_flag_for_a_missing_checkpoint(script, flag, tmp_path):
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    missing = str(tmp_path / "no-such-model")
    proc = subprocess.run([sys.executable, f"scripts/{script}", flag, missing, "--out", str(tmp_path / "out")],
                          cwd=repo, capture_output=True, text=True)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0].startswith(f"error: {flag} {missing}: no such directory"), err[0]
    assert not os.path.exists(tmp_path / "out")
