"""Run train_rl.py arms as subprocesses and summarise their metrics.jsonl (shared by the RL-at-scale
benchmarks: async_rollout.py, dynamic_sampling.py, rollout_engines.py)."""
import json
import math
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_arm(name, out_root, flags, timeout=3600):
    """train_rl.py with `flags` into OUT_ROOT/name; returns its metrics rows (exits on failure)."""
    out = os.path.join(out_root, name)
    cmd = [sys.executable, os.path.join(REPO, "train_rl.py"), "--output-dir", out, "--progress", "false",
           "--no-use-wandb", *map(str, flags)]
    print(f"[bench] {name}: {' '.join(cmd[2:])}", flush=True)
    env = dict(os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"), WANDB_SILENT="true")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"[bench] arm {name} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def mean_se(values):
    """(mean, standard error of the mean) of a list of per-step values."""
    values = list(values)
    if len(values) < 2:
        return (values[0] if values else float("nan")), float("nan")
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def column(rows, key, skip=0, default=None):
    """Per-step values of `key` from step `skip` on (skip the warm-up step of timings)."""
    return [r.get(key, default) for r in rows[skip:]]


def fmt(mean, se):
    return f"{mean:.4g} ± {se:.2g}" if not math.isnan(se) else f"{mean:.4g}"
