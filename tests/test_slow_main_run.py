"""The README's main command end to end on the shipped tiny model (slow: ~2 minutes on 2 cores).

Run with `python -m pytest -m slow`."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_readme_main_run_raises_reward_and_acceptance_length(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("WANDB_API_KEY", None)
    proc = subprocess.run([sys.executable, "train_rl.py", "--enable-mtp-training", "--mtp-num-layers", "1",
                           "--output-dir", str(tmp_path), "--progress", "false"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]

    def mean(key, part):
        return sum(r[key] for r in part) / len(part)

    first, last = rows[:5], rows[-5:]
    assert mean("rollout/reward", last) > mean("rollout/reward", first) + 0.2
    assert mean("rollout/spec_accept_length", last) > mean("rollout/spec_accept_length", first) + 0.3
