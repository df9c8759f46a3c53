"""HF <-> torch_dist conversion keeps MTP weights bit-identically; refusals are one-line errors."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_convert import hf_to_torch_dist, torch_dist_to_hf
from vime.models.families import FAMILIES, MOE_FAMILIES, MTP_FAMILIES
from vime.models.hf_format import load_hf_checkpoint
from mtp.sampling import token_logprobs
from rollout.embedded.model import CausalLMWithMTP
from trainer.config import TrainerConfig
from trainer.trainer import Trainer
from trainer_fixtures import make_batch, make_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("family", sorted(MTP_FAMILIES + MOE_FAMILIES))
def test_hf_to_torch_dist_to_hf_is_bit_identical(tmp_path, family):
    hf, td, back = (str(tmp_path / n) for n in ("hf", "td", "back"))
    make_tiny(hf, seed=6, family=family, tie_word_embeddings=family == "qwen3")
    hf_to_torch_dist.main(["--hf-checkpoint", hf, "--save", td, "--mtp-num-layers", "1"])
    torch_dist_to_hf.main(["--input-dir", td, "--output-dir", back, "--origin-hf-dir", hf])
    original, converted = load_file(f"{hf}/model.safetensors"), load_file(f"{back}/model.safetensors")
    assert set(original) == set(converted)
    assert any(".mtp_layers." in n for n in converted) == (family == "mimo")
    assert any(n.endswith("q_proj.bias") for n in converted) == FAMILIES[family].qkv_bias
    assert all(torch.equal(original[n], converted[n]) for n in original)
    assert os.path.isfile(f"{back}/tokenizer.json")
    with open(f"{back}/config.json") as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1


def test_trainer_logprobs_on_converted_checkpoint_equal_engine_model(tmp_path):
    hf, td = str(tmp_path / "hf"), str(tmp_path / "td")
    make_tiny(hf, seed=7, family="mimo")
    hf_to_torch_dist.main(["--hf-checkpoint", hf, "--save", td, "--mtp-num-layers", "1"])
    trainer = Trainer(TrainerConfig(temperature=0.9), hf, load=td)
    batch = make_batch(seed=3)
    got = trainer.compute_logprobs(batch)[:, 1:]
    cfg, state, _ = load_hf_checkpoint(hf)
    engine = CausalLMWithMTP(cfg)
    engine.load_state_dict(state, strict=False)
    positions = torch.arange(batch.tokens.shape[1]).expand_as(batch.tokens)
    with torch.no_grad():
        want = token_logprobs(engine.logits(engine(batch.tokens, positions))[:, :-1], batch.tokens[:, 1:], 0.9)
    assert (got - want).abs().max().item() <= 1e-5


def test_drop_mtp_converts_the_trunk_only(tmp_path):
    hf, td = str(tmp_path / "hf"), str(tmp_path / "td")
    make_tiny(hf, seed=8)
    hf_to_torch_dist.main(["--hf-checkpoint", hf, "--save", td, "--drop-mtp"])
    with open(f"{td}/vime_meta.json") as f:
        assert json.load(f)["mtp_num_layers"] == 0


def run_cli(module, *args):
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr


def assert_one_line_refusal(rc, stderr, *needles):
    lines = [line for line in stderr.strip().splitlines() if line.strip() and "Warning" not in line
             and not line.startswith("  warnings.warn")]
    assert rc == 2, stderr
    assert "Traceback" not in stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[0]


@pytest.fixture(scope="module")
def hf_with_mtp(tmp_path_factory):
    path = tmp_path_factory.mktemp("refusal_hf")
    make_tiny(path, seed=9)
    return str(path)


def test_refuses_more_mtp_layers_than_the_checkpoint_has(hf_with_mtp, tmp_path):
    rc, err = run_cli("checkpoint_convert.hf_to_torch_dist", "--hf-checkpoint", hf_with_mtp,
                      "--save", str(tmp_path / "o"), "--mtp-num-layers", "2")
    assert_one_line_refusal(rc, err, "--mtp-num-layers 2", "1 MTP layers")


def test_refuses_to_drop_mtp_layers_silently(hf_with_mtp, tmp_path):
    rc, err = run_cli("checkpoint_convert.hf_to_torch_dist", "--hf-checkpoint", hf_with_mtp, "--save", str(tmp_path / "o"))
    assert_one_line_refusal(rc, err, "MTP weights would be dropped", "--drop-mtp")


def edited_copy(src, dst, **config_changes):
    """A copy of checkpoint `src` whose config.json has `config_changes` (None deletes a key)."""
    os.makedirs(dst)
    for name in os.listdir(src):
        data = open(os.path.join(src, name), "rb").read()
        open(os.path.join(dst, name), "wb").write(data)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    for key, value in config_changes.items():
        cfg.pop(key) if value is None else cfg.__setitem__(key, value)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


@pytest.mark.parametrize("changes, needles", [
    (dict(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox"),
     ("GPTNeoXForCausalLM", "not a supported model family", "mimo (MiMoForCausalLM)", "qwen3 (Qwen3ForCausalLM)")),
    (dict(num_nextn_predict_layers=None), ("holds 1 MTP layers", "set num_nextn_predict_layers to 1")),
    (dict(num_nextn_predict_layers=0), ("holds 1 MTP layers", "set num_nextn_predict_layers to 1")),
    (dict(num_nextn_predict_layers=2), ("declares num_nextn_predict_layers=2", "holds 1 MTP layers", "incomplete")),
], ids=["unknown-family", "mtp-count-missing", "mtp-count-zero", "mtp-count-larger"])
def test_refuses_a_checkpoint_whose_family_or_mtp_count_does_not_match(hf_with_mtp, tmp_path, changes, needles):
    bad = edited_copy(hf_with_mtp, tmp_path / "bad", **changes)
    rc, err = run_cli("checkpoint_convert.hf_to_torch_dist", "--hf-checkpoint", bad,
                      "--save", str(tmp_path / "o"), "--mtp-num-layers", "1")
    assert_one_line_refusal(rc, err, *needles)


def test_refuses_a_missing_checkpoint_directory(tmp_path):
    rc, err = run_cli("checkpoint_convert.hf_to_torch_dist", "--hf-checkpoint", str(tmp_path / "nope"),
                      "--save", str(tmp_path / "o"), "--mtp-num-layers", "1")
    assert_one_line_refusal(rc, err, "no such directory")


def test_refuses_a_malformed_config(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    rc, err = run_cli("checkpoint_convert.hf_to_torch_dist", "--hf-checkpoint", str(tmp_path / "bad"),
                      "--save", str(tmp_path / "o"), "--mtp-num-layers", "1")
    assert_one_line_refusal(rc, err, "malformed JSON")


def test_refuses_a_truncated_weights_file(hf_with_mtp, tmp_path):
    bad = tmp_path / "trunc"
    bad.mkdir()
    for name in os.listdir(hf_with_mtp):
        data = open(os.path.join(hf_with_mtp, name), "rb").read()
        (bad / name).write_bytes(data[:100] if name == "model.safetensors" else data)
    rc, err = run_cli("checkpoint_convert.hf_to_torch_dist", "--hf-checkpoint", str(bad),
                      "--save", str(tmp_path / "o"), "--mtp-num-layers", "1")
    assert_one_line_refusal(rc, err, "model.safetensors")


def test_refuses_tensor_parallel_size_that_does_not_divide_the_heads(hf_with_mtp, tmp_path):
    rc, err = run_cli("checkpoint_convert.hf_to_torch_dist", "--hf-checkpoint", hf_with_mtp,
                      "--save", str(tmp_path / "o"), "--mtp-num-layers", "1", "--tensor-model-parallel-size", "3")
    assert_one_line_refusal(rc, err, "--tensor-model-parallel-size 3", "does not divide")


def test_refuses_a_torch_dist_input_that_is_not_a_checkpoint(hf_with_mtp, tmp_path):
    (tmp_path / "empty").mkdir()
    rc, err = run_cli("checkpoint_convert.torch_dist_to_hf", "--input-dir", str(tmp_path / "empty"),
                      "--output-dir", str(tmp_path / "o"), "--origin-hf-dir", hf_with_mtp)
    assert_one_line_refusal(rc, err, "vime_meta.json")
