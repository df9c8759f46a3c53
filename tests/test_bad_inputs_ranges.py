"""Every numeric flag's range, and the inputs that used to pass silently or end in a traceback:
prompt files that are not UTF-8, responses longer than the model's context, weights whose shapes
disagree with config.json. One line naming the flag or file, exit code 2, before any actor (or,
for the tools, any model) starts.

Each parametrized case is one distinct bad input; `BAD_INPUT_CASES` counts them."""
import json
import math
import os
import subprocess
import sys
import typing

import pytest
from safetensors.torch import load_file, save_file

from checkpoint_convert import hf_to_torch_dist
from train_rl import prepare
from rollout import generate
from rollout.task import make_prompts, write_jsonl
from rollout.tiny_model import make_random_checkpoint
from tests.conftest import SMALL
from tests.test_bad_inputs import args_for, copy_ckpt, refused
from tests.test_bad_inputs_tools import refusal
from vime.cli_config import load_config
from vime.config import RANGES, flag_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ranges_ckpt"))
    make_random_checkpoint(path, seed=5, std=0.3, **SMALL)
    write_jsonl(make_prompts(8, seed=1), os.path.join(path, "train.jsonl"))
    return path


def _kind(f):
    inner = [t for t in typing.get_args(f.type) if t is not type(None)] or [f.type]
    return inner[0]


def numeric_flags():
    return {name: _kind(f) for name, (_, f) in flag_table().items() if _kind(f) in (int, float)}


def out_of_range_values(name, kind):
    """Values just outside the flag's range on each bounded side (and NaN / inf for a float)."""
    r = RANGES[name]
    step = 1 if kind is int else 0.5
    values = []
    if r.low is not None:
        values.append(kind(r.low) if r.low_open else kind(r.low - step))
    if r.high is not None:
        values.append(kind(r.high) if r.high_open else kind(r.high + step))
    if kind is float:
        values += [math.nan, math.inf]
    return values


RANGE_CASES = [(name, value) for name, kind in sorted(numeric_flags().items())
               for value in out_of_range_values(name, kind)]


def test_every_numeric_flag_declares_its_range():
    assert sorted(numeric_flags()) == sorted(RANGES)


@pytest.mark.parametrize("flag, value", RANGE_CASES, ids=[f"{f}={v}" for f, v in RANGE_CASES])
def test_a_numeric_flag_outside_its_range_is_one_line_naming_it(ckpt, tmp_path, flag, value):
    text = str(value)
    refused(args_for(ckpt, tmp_path, flag, text), f"{flag} {text}")


@pytest.mark.parametrize("flag", sorted(RANGES))
def test_the_edge_of_every_range_is_accepted(flag):
    """The negative control: the bound itself (a closed side) or the value just inside passes the range check."""
    from vime.config import check_flag_ranges

    r = RANGES[flag]
    kind = numeric_flags()[flag]
    edge = r.low if r.low is not None else r.high
    inside = kind(edge) if not r.low_open else (kind(edge) + 1 if kind is int else edge + min(1e-3, (r.high or 1) / 2))
    check_flag_ranges({flag: inside}, RANGES)


def test_save_keep_without_save_is_refused(ckpt, tmp_path):
    refused(args_for(ckpt, tmp_path, "--save-keep", 2), "--save-keep 2 needs --save DIR")


# ---- prompt files that are not UTF-8 ----------------------------------------------------------------
def test_a_prompt_file_with_a_non_utf8_byte_names_the_file_line_and_byte(ckpt, tmp_path):
    bad = tmp_path / "latin1.jsonl"
    second = b'{"prompt": "caf\xe9", "label": "3"}\n'
    bad.write_bytes(b'{"prompt": "1+1=", "label": "2"}\n' + second)
    column = second.index(b"\xe9") + 1
    refused(args_for(ckpt, tmp_path, "--prompt-data", bad), f"--prompt-data {bad}: line 2, byte {column} (0xe9)",
            "not UTF-8")


# ---- the response must fit the context next to the prompt -------------------------------------------
def test_a_response_longer_than_the_context_is_refused_with_both_numbers(ckpt, tmp_path):
    from rollout.tokenizer import TextCodec

    codec = TextCodec(ckpt)
    longest = max(len(codec.encode_prompt(p["prompt"], 1)) for p in map(json.loads, open(os.path.join(ckpt, "train.jsonl"))))
    context = json.load(open(os.path.join(ckpt, "config.json")))["max_position_embeddings"]
    fits = context - longest
    prepare(load_config(args_for(ckpt, tmp_path, "--rollout-max-response-len", fits)))  # the edge passes
    refused(args_for(ckpt, tmp_path, "--rollout-max-response-len", fits + 1),
            f"--rollout-max-response-len {fits + 1}", f"({longest} tokens)", f"{context + 1} positions",
            f"context of {context}")


# ---- weights against config.json ----------------------------------------------------------------------
def _reshape(path, name, shape):
    weights = os.path.join(path, "model.safetensors")
    state = load_file(weights)
    import torch

    state[name] = torch.zeros(shape)
    save_file(state, weights, metadata={"format": "pt"})


@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.mlp.up_proj.weight", (100, 64)),             # a trunk tensor
    ("model.mtp_layers.0.input_proj.weight", (64, 64)),           # the MTP layer's projection
    ("model.embed_tokens.weight", (33, 64)),                      # a vocabulary one row longer
])
def test_weights_whose_shape_disagrees_with_config_json_are_refused_naming_both_shapes(ckpt, tmp_path, name, shape):
    path = copy_ckpt(ckpt, tmp_path)
    _reshape(path, name, shape)
    state = load_file(os.path.join(ckpt, "model.safetensors"))
    refused(args_for(path, tmp_path), "disagrees with config.json", f"{name} has shape {list(shape)} but the config (",
            f") gives {list(state[name].shape)}")


# ---- the tools ---------------------------------------------------------------------------------------
GENERATE_CASES = [(flag, value) for flag, r in sorted(generate.GENERATE_RANGES.items())
                  for value in ([r.low] if r.low_open else [r.low - 1]) + ([r.high + 1] if r.high is not None else [])]


@pytest.mark.parametrize("flag, value", GENERATE_CASES, ids=[f"{f}={v}" for f, v in GENERATE_CASES])
def test_generate_refuses_a_numeric_flag_outside_its_range(ckpt, tmp_path, capsys, flag, value):
    line = refusal(capsys, generate.main, ["--hf-checkpoint", ckpt, "--prompts", os.path.join(ckpt, "train.jsonl"),
                                           "--output", str(tmp_path / "o.jsonl"), flag, str(value)])
    assert line.startswith(f"error: {flag} {value}"), line


def test_generate_refuses_max_new_tokens_beyond_the_context_with_both_numbers(ckpt, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [1, 5, 6, 7]}) + "\n")
    context = json.load(open(os.path.join(ckpt, "config.json")))["max_position_embeddings"]
    line = refusal(capsys, generate.main, ["--hf-checkpoint", ckpt, "--prompts", str(prompts), "--output",
                                           str(tmp_path / "o.jsonl"), "--max-new-tokens", "100000"])
    assert "--max-new-tokens 100000" in line and "4-token prompt" in line and "100004 positions" in line
    assert f"context of {context}" in line and f"--max-new-tokens {context - 4} or less" in line


def test_generate_names_the_line_and_byte_of_a_prompt_file_that_is_not_utf8(ckpt, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    second = b'{"prompt": "\xff"}\n'
    prompts.write_bytes(b'{"prompt": "1+1="}\n' + second)
    line = refusal(capsys, generate.main, ["--hf-checkpoint", ckpt, "--prompts", str(prompts), "--output",
                                           str(tmp_path / "o.jsonl")])
    column = second.index(b"\xff") + 1
    assert f"--prompts {prompts}: line 2, byte {column} (0xff) is not UTF-8" in line


CONVERTER_CASES = [("--mtp-num-layers", -1), ("--tensor-model-parallel-size", 0), ("--pipeline-model-parallel-size", 0)]


@pytest.mark.parametrize("flag, value", CONVERTER_CASES)
def test_hf_to_torch_dist_refuses_a_numeric_flag_outside_its_range(ckpt, tmp_path, capsys, flag, value):
    line = refusal(capsys, hf_to_torch_dist.main, ["--hf-checkpoint", ckpt, "--save", str(tmp_path / "d"),
                                                   flag, str(value)])
    assert line.startswith(f"error: {flag} {value}: must be >= "), line
    assert not os.path.exists(tmp_path / "d")


def test_train_rl_refuses_an_out_of_range_flag_in_one_line_exit_2_without_starting_ray(ckpt, tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline")
    proc = subprocess.run([sys.executable, "train_rl.py", *args_for(ckpt, tmp_path, "--adam-eps", "nan")],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [x for x in proc.stderr.splitlines() if x.startswith("error:")] == ["error: --adam-eps nan: must be > 0"]
    assert "Ray" not in proc.stdout + proc.stderr


# one per distinct bad input above (the train_rl.py subprocess case repeats a RANGE_CASES input)
BAD_INPUT_CASES = len(RANGE_CASES) + 1 + 1 + 1 + 3 + len(GENERATE_CASES) + 2 + len(CONVERTER_CASES)


def test_at_least_60_distinct_bad_inputs_are_covered_here():
    assert BAD_INPUT_CASES >= 60, BAD_INPUT_CASES
