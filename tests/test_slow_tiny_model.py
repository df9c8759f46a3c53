"""`scripts/make_tiny_model.py` reproduces the tiny model shipped in checkpoints/tiny-mimo-mtp
(slow: a full pretraining run, ~25 minutes on 2 cores). Run with `python -m pytest -m slow`.

On the CPU and torch that made the shipped files (PROVENANCE.json) the weights are bit-identical.
Elsewhere fp32 reduction order differs, training diverges in its low bits and only the model's
behaviour can be compared: greedy accuracy and the share of step-by-step answers on the eval
prompts must agree within a two-proportion test at 4 standard errors.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from vime.config import DEFAULT_TINY_MODEL

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def provenance_matches(shipped):
    with open(os.path.join(shipped, "PROVENANCE.json")) as f:
        made_on = json.load(f)
    # Thread count changes the reduction order as much as the CPU does.
    threads = max(1, (os.cpu_count() or 2) // 2)  # make_tiny_model.py's default
    return (made_on.get("torch") == torch.__version__ and made_on.get("cpu") == cpu_model_name()
            and made_on.get("threads") == threads)


def cpu_model_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def greedy_behaviour(path, n=256):
    """(accuracy, share of step-by-step answers) of greedy answers to the first n eval prompts."""
    from rollout.embedded.engine import EngineConfig
    from vime.sample import samples_for_prompts
    from rollout.sampling_params import SamplingParams
    from rollout.embedded.engine_builder import build_engine
    from rollout.task import tiny_add_reward
    from rollout.tokenizer import TextCodec

    rows = [json.loads(x) for x in open(os.path.join(path, "eval.jsonl"))][:n]
    codec = TextCodec(path)
    engine = build_engine(path, None, EngineConfig(max_batch_size=n))
    out = engine.generate(samples_for_prompts([codec.encode_prompt(r["prompt"], 1) for r in rows]),
                          SamplingParams(temperature=0, max_new_tokens=64))
    acc = sum(tiny_add_reward(s.response, r["label"]) for s, r in zip(out, rows)) / n
    trace = sum(";" in s.response for s in out) / n
    return acc, trace, n


def within_two_proportion_test(p1, p2, n, z=4.0):
    pooled = (p1 + p2) / 2
    se = math.sqrt(max(pooled * (1 - pooled), 1.0 / n) * 2 / n)
    return abs(p1 - p2) <= z * se


@pytest.mark.slow
@pytest.mark.timeout(5400)  # a full pretraining run: past pytest.ini's 900 s per test
def test_make_tiny_model_reproduces_the_shipped_checkpoint(tmp_path):
    out = str(tmp_path / "tiny")
    proc = subprocess.run([sys.executable, "scripts/make_tiny_model.py", "--out", out], cwd=REPO,
                          capture_output=True, text=True, timeout=5400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shipped, made = load_file(f"{DEFAULT_TINY_MODEL}/model.safetensors"), load_file(f"{out}/model.safetensors")
    assert {n: t.shape for n, t in shipped.items()} == {n: t.shape for n, t in made.items()}
    for name in ("config.json", "tokenizer.json", "train.jsonl", "eval.jsonl"):
        assert open(os.path.join(out, name)).read() == open(os.path.join(DEFAULT_TINY_MODEL, name)).read(), name
    if provenance_matches(DEFAULT_TINY_MODEL):
        assert all(torch.equal(shipped[n], made[n]) for n in shipped)
    acc0, trace0, n = greedy_behaviour(DEFAULT_TINY_MODEL)
    acc1, trace1, _ = greedy_behaviour(out)
    assert within_two_proportion_test(acc0, acc1, n), (acc0, acc1)
    assert within_two_proportion_test(trace0, trace1, n), (trace0, trace1)
