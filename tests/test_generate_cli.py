"""`python -m rollout.generate`: outputs, and one-line errors (exit 2, no traceback) for bad input."""
import json
import os
import subprocess
import sys

import pytest

from safetensors.torch import load_file, save_file

from tests.test_bad_inputs_tools import refusal

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "rollout.generate", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120)


def refused_in_process(capsys, args, *needles):
    """`rollout.generate.main` refuses `args` in this process with one line holding every needle (exit 2): the
    refusals come before any model is built, so a process of their own would mostly time Python's imports.
    The tests of a missing checkpoint or weights file run the real process."""
    from rollout import generate

    line = refusal(capsys, generate.main, list(map(str, args)))
    assert all(n in line for n in needles), line


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def assert_one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [x for x in proc.stderr.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_cli_writes_one_line_per_sample_with_logprobs(tmp_path, small_ckpt):
    prompts = write(tmp_path / "p.jsonl", [json.dumps({"prompt": "12+34="}), json.dumps({"prompt_ids": [1, 5, 6]})])
    out = tmp_path / "out.jsonl"
    proc = run_cli("--hf-checkpoint", small_ckpt, "--prompts", prompts, "--output", out,
                   "--max-new-tokens", 8, "--temperature", 0.7, "--n", 2, "--seed", 1)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in rows:
        assert 1 <= len(r["response_ids"]) <= 8 and len(r["logprobs"]) == len(r["response_ids"])
        assert all(lp <= 0 for lp in r["logprobs"]) and r["finish_reason"] in ("stop", "length")
    assert "tokens/s" in proc.stdout


@pytest.fixture()
def prompts(tmp_path):
    return write(tmp_path / "ok.jsonl", [json.dumps({"prompt": "1+2="})])


def test_missing_checkpoint_directory_is_a_one_line_error(tmp_path, prompts):
    assert_one_line_error(run_cli("--hf-checkpoint", tmp_path / "nope", "--prompts", prompts, "--output",
                                  tmp_path / "o"), "--hf-checkpoint", "no such directory")


def test_incomplete_checkpoint_is_a_one_line_error(tmp_path, small_ckpt, prompts, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(small_ckpt):
        if name != "model.safetensors":
            (broken / name).write_bytes(open(os.path.join(small_ckpt, name), "rb").read())
    assert_one_line_error(run_cli("--hf-checkpoint", broken, "--prompts", prompts, "--output", tmp_path / "o"),
                          "model.safetensors is missing")
    state = load_file(os.path.join(small_ckpt, "model.safetensors"))
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, str(broken / "model.safetensors"))
    refused_in_process(capsys, ["--hf-checkpoint", broken, "--prompts", prompts, "--output", tmp_path / "o"],
                       "missing", "incomplete")


@pytest.mark.parametrize("small_ckpt", ["mimo"], indirect=True)  # the prompt file's checks know no family
@pytest.mark.parametrize("lines, needle", [
    (['{"prompt": "1+2="}', '{"prompt": "3+4="'], "line 2 is not valid JSON"),
    (['{"prompt": ""}'], "line 1: the prompt is empty"),
    (['{"text": "1+2="}'], "line 1 has neither 'prompt' nor 'prompt_ids'"),
    (['{"prompt_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]}'], "the context is"),
])
def test_bad_prompt_files_name_the_line(tmp_path, small_ckpt, lines, needle, capsys):
    bad = write(tmp_path / "bad.jsonl", lines)
    ckpt = small_ckpt
    if "context" in needle:
        # the small fixture's context is 256; a long prompt needs a model with a short one
        from rollout.tiny_model import make_random_checkpoint
        from tests.conftest import SMALL

        ckpt = str(tmp_path / "short")
        make_random_checkpoint(ckpt, max_position_embeddings=12, **SMALL)
    refused_in_process(capsys, ["--hf-checkpoint", ckpt, "--prompts", bad, "--output", tmp_path / "o",
                                "--max-new-tokens", 4], needle)


@pytest.mark.parametrize("flag, value", [("--max-new-tokens", 0), ("--temperature", -0.5), ("--top-p", 0),
                                         ("--top-p", 1.5)])
def test_bad_sampling_flags_are_one_line_errors(tmp_path, small_ckpt, prompts, flag, value, capsys):
    refused_in_process(capsys, ["--hf-checkpoint", small_ckpt, "--prompts", prompts, "--output", tmp_path / "o",
                                flag, value], flag)


@pytest.mark.parametrize("small_ckpt", ["mimo"], indirect=True)  # a tokenizer without a chat template
def test_apply_chat_template_on_a_tokenizer_without_one_is_a_one_line_error(tmp_path, small_ckpt, capsys):
    chat = write(tmp_path / "chat.jsonl", [json.dumps({"messages": [{"role": "user", "content": "1+2="}]})])
    refused_in_process(capsys, ["--hf-checkpoint", small_ckpt, "--prompts", chat, "--output", tmp_path / "o",
                                "--apply-chat-template"], "--apply-chat-template", "no chat template")
    assert not (tmp_path / "o").exists()
