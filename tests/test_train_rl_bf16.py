"""train_rl.py --bf16 end to end on CPU (real Ray, megatron-core on gloo, the embedded engine and vLLM).

Each run trains the MTP layer online and syncs it with the trunk every step, as bf16 on the wire;
the sync guard compares bf16 sums (and, with --check-weight-update-equal, the bf16 bit patterns)
after every sync and stops the run on any difference, so a run that completes passed it every
step. The trainer-vs-rollout log-prob difference is checked against the bound derived for two bf16
forwards (tests/fp32_bounds.py), its scale taken from each step's own rollouts.
"""
import json
import os
import pickle
import subprocess
import sys

import pytest

from fp32_bounds import bf16_logprob_bound, max_abs_logit
from rollout.task import make_prompts, write_jsonl
from rollout.tiny_model import make_random_checkpoint
from tests.conftest import SMALL
from tests.mimo_fixtures import make_tiny_mimo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = '{"method":"mtp","num_speculative_tokens":2}'
STEPS = 3


def run_train(*args, timeout=1200):
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("WANDB_API_KEY", None)
    return subprocess.run([sys.executable, "train_rl.py", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)


def bf16_run(ckpt, out, *extra):
    rollouts = os.path.join(out, "rollouts")
    proc = run_train("--hf-checkpoint", ckpt, "--bf16", "--num-rollout", STEPS, "--rollout-batch-size", 4,
                     "--n-samples-per-prompt", 4, "--global-batch-size", 16, "--micro-batch-size", 8,
                     "--rollout-max-response-len", 12, "--lr", 1e-3, "--rollout-temperature", 1.0,
                     "--custom-rm-path", "tests.rewards_for_tests:parity_reward", "--output-dir", out,
                     "--progress", "false", "--vllm-speculative-config", SPEC, "--enable-mtp-training",
                     "--mtp-num-layers", 1, "--check-weight-update-equal", "--save-debug-rollout-data", rollouts, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))], rollouts


def synced_bytes(ckpt):
    """Bytes one sync moves if every tensor of the checkpoint goes as bf16 (2 bytes a value)."""
    from safetensors import safe_open

    with safe_open(os.path.join(ckpt, "model.safetensors"), framework="pt") as f:
        return 2 * sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def check_bf16_run(rows, rollouts, ckpt):
    from vime.models.hf_format import read_config

    cfg = read_config(ckpt)
    assert [r["rollout/step"] for r in rows] == list(range(STEPS))
    for step, r in enumerate(rows):
        # the guard compared the worker's bf16 sums with the trainer's (a difference stops the run)
        assert r["weight_sync/worker_draft_checksum"] == r["weight_sync/draft_checksum"]
        assert r["weight_sync/draft_stale"] == 0
        assert r["weight_sync/bytes"] == synced_bytes(ckpt)  # bf16 on the wire: half the fp32 bytes
        with open(os.path.join(rollouts, f"step_{step:07d}.pkl"), "rb") as f:
            samples = pickle.load(f)
        tol = bf16_logprob_bound(cfg.num_hidden_layers, max(cfg.intermediate_size, cfg.hidden_size, cfg.vocab_size),
                                 max_abs_logit(ckpt, samples), 1.0)
        assert r["train/logprob_abs_diff"] <= tol, (step, r["train/logprob_abs_diff"], tol)
        assert r["rollout/spec_draft_tokens"] > 0 and r["rollout/spec_accepted_tokens"] > 0
    assert len({r["weight_sync/draft_checksum"] for r in rows}) == STEPS  # the draft trained and followed


@pytest.mark.slow
def test_a_bf16_run_on_the_embedded_engine_passes_the_guard_every_step(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    make_random_checkpoint(ckpt, seed=5, std=0.3, **SMALL)
    write_jsonl(make_prompts(64, seed=1), os.path.join(ckpt, "train.jsonl"))
    rows, rollouts = bf16_run(ckpt, str(tmp_path / "out"))
    check_bf16_run(rows, rollouts, ckpt)


@pytest.mark.slow
def test_a_bf16_run_on_vllm_passes_the_guard_every_step(tmp_path):
    pytest.importorskip("vllm")
    ckpt = make_tiny_mimo(str(tmp_path / "ckpt"), seed=5)
    write_jsonl(make_prompts(64, seed=1), os.path.join(ckpt, "train.jsonl"))
    rows, rollouts = bf16_run(ckpt, str(tmp_path / "out"), "--rollout-backend", "vllm")
    check_bf16_run(rows, rollouts, ckpt)
