"""Online EAGLE-3 in the RL loop, end to end on both backends (slow: real Ray, megatron-core, vLLM).

After every sync the rollout's draft equals the trainer's (--check-weight-update-equal compares
every tensor, and the guard's draft checksums agree and are not empty); the draft really moved;
the run saves it with its optimizer state and `scripts/export_eagle3_draft.py` writes it as a
draft directory that the embedded engine and plain vLLM load.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from eagle3_fixtures import DRAFT, REPO, TARGET

pytestmark = pytest.mark.slow
SPEC = json.dumps({"method": "eagle3", "model": DRAFT, "num_speculative_tokens": 3})


def run_online(tmp_path, backend):
    out, save = tmp_path / "run", tmp_path / "save"
    cmd = [sys.executable, "train_rl.py", "--hf-checkpoint", TARGET, "--vllm-speculative-config", SPEC,
           "--enable-draft-training", "--rollout-backend", backend, "--num-rollout", "2", "--output-dir", str(out),
           "--save", str(save), "--save-interval", "2", "--check-weight-update-equal", "--progress", "false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in open(out / "metrics.jsonl")], str(save)


@pytest.mark.parametrize("backend", ["embedded", "vllm"])
def test_the_online_draft_reaches_the_rollout_every_step_and_exports(tmp_path, backend):
    from safetensors.torch import load_file

    metrics, save = run_online(tmp_path, backend)
    for m in metrics:
        assert m["weight_sync/draft_checksum"] != 0.0  # the draft is in the guard's comparison
        assert m["weight_sync/draft_checksum"] == m["weight_sync/worker_draft_checksum"]
        assert m["weight_sync/draft_stale"] == 0
        assert m["train/draft_1_loss"] > 0
    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "scripts/export_eagle3_draft.py", "--load", save, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after = load_file(os.path.join(DRAFT, "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # two optimiser steps moved it
    from rollout.embedded.engine_builder import build_engine

    build_engine(TARGET, {"method": "eagle3", "model": str(out), "num_speculative_tokens": 3})  # loads and checks
