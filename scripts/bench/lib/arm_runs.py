"""Run train_rl.py arms as subprocesses and read their metrics: what every RL-arms benchmark shares.

An arm is one train_rl.py run with its own flags into OUT/NAME; its per-step metrics are the rows
of OUT/NAME/metrics.jsonl. The statistics here are over those per-step rows.
"""
import json
import math
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def read_metrics(out):
    """The metrics rows of a run directory ([] when it has none yet)."""
    path = os.path.join(out, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.isfile(path) else []


def run_arm(name, out_root, flags, steps=None, reuse=False, timeout=None):
    """train_rl.py with `flags` into OUT_ROOT/name; its metrics rows. With `reuse`, a directory that
    already holds `steps` steps is read instead of rerun (a longer run's first steps are this run:
    same seed, same flags). A failed arm ends the benchmark with the run's last stderr lines."""
    out = os.path.join(out_root, name)
    done = read_metrics(out)
    if reuse and steps and len(done) >= steps:
        print(f"[bench] {name}: reusing the first {steps} steps of {out}", flush=True)
        return done[:steps]
    cmd = [sys.executable, os.path.join(REPO, "train_rl.py"), "--output-dir", out, "--progress", "false",
           "--no-use-wandb", *map(str, flags)]
    print(f"[bench] {name}: {' '.join(cmd[2:])}", flush=True)
    # a benchmark's Ray is local and short-lived: no token set-up; wandb stays quiet
    env = dict(os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"), WANDB_SILENT="true")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"[bench] arm {name} failed:\n{proc.stderr[-3000:]}")
    return read_metrics(out)


def mean_se(values):
    """(mean, standard error of the mean) of per-step values (NaN SE for fewer than two)."""
    values = list(values)
    if len(values) < 2:
        return (values[0] if values else float("nan")), float("nan")
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def column(rows, key, skip=0, default=None):
    """Per-step values of `key` from step `skip` on (skip the warm-up step of timings)."""
    return [r.get(key, default) for r in rows[skip:]]


def window(rows, key, first, size):
    """Mean of `key` over the first or last `size` rows, over the rows that have it (a step that
    drafted nothing at a position has no acceptance there)."""
    part = rows[:size] if first else rows[-size:]
    values = [r[key] for r in part if r.get(key) not in (None, "")]
    return statistics.fmean(values) if values else float("nan")


def fmt(mean, se):
    """'mean ± se' (just the mean when there is no SE)."""
    return f"{mean:.4g} ± {se:.2g}" if not math.isnan(se) else f"{mean:.4g}"
