"""The README's claim, shortened so CI runs it (`python -m pytest -m e2e`, a few minutes on 2 cores):
on the default tiny model, GRPO raises reward and acceptance length, and the online-trained
draft is accepted more than the frozen one on the same run."""
import json
import os
import subprocess
import sys

import pytest

from vime.config import DEFAULT_TINY_MODEL

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, WINDOW = 12, 4


def run(out, *extra):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("WANDB_API_KEY", None)
    proc = subprocess.run([sys.executable, "train_rl.py", "--hf-checkpoint", DEFAULT_TINY_MODEL,
                           "--num-rollout", str(STEPS), "--output-dir", str(out), "--progress", "false",
                           "--use-wandb", "false", *extra], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=3000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


def mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


@pytest.mark.e2e
def test_reward_and_acceptance_rise_and_the_online_draft_beats_the_frozen_one(tmp_path):
    online = run(tmp_path / "online", "--enable-mtp-training", "--mtp-num-layers", "1")
    frozen = run(tmp_path / "frozen")
    assert [r["rollout/step"] for r in online] == list(range(STEPS))
    first, last = online[:WINDOW], online[-WINDOW:]
    assert mean(last, "rollout/reward") > mean(first, "rollout/reward")
    assert mean(last, "rollout/spec_accept_length") > mean(first, "rollout/spec_accept_length")
    # same seed, same prompts: only the draft's training differs
    assert mean(last, "rollout/spec_accept_length") > mean(frozen[-WINDOW:], "rollout/spec_accept_length")
