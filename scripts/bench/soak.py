#!/usr/bin/env python
"""Soak benchmark: one long train_rl.py run, watched from outside (not CI).

    python scripts/bench/soak.py                       # 200 steps on the shipped tiny model
    python scripts/bench/soak.py --steps 60 -- --rollout-backend vllm

Samples the resident memory (RSS) of every process of the run twice a second: the driver, each
Ray actor (named by its process title: TrainerActor, RolloutWorker, RolloutManager), vLLM's
engine processes and Ray's own daemons. Prints, per process, its RSS when step 20 had finished
and its peak after that, with the ratio (a leak grows it step after step; a flat process stays within
10 %). It also lists /dev/shm and the system temp dir before and after the run and prints what the
run left behind (other programs on the machine can add entries meanwhile: the listing names them,
so a reader can tell). The run saves every 50 steps and keeps 2 checkpoints, so the soak covers the
save path too. Extra arguments after `--` go to train_rl.py.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASELINE_STEP = 20
SAMPLE_EVERY_S = 0.5


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="RL steps (default 200)")
    p.add_argument("--out", default="runs/soak", help="the run's --output-dir; checkpoints go to OUT/save")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.steps <= BASELINE_STEP:
        p.error(f"--steps must be > {BASELINE_STEP} (the baseline is step {BASELINE_STEP}'s RSS)")
    return args, extra


def label(proc):
    """A readable name of one process of the run (Ray's process titles name the actor class)."""
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    if cmd.startswith("ray::"):  # a Ray worker's process title: ray::ActorClass[.method]
        return cmd.split()[0][len("ray::"):].split(".")[0]
    for key in ("TrainerActor", "RolloutWorker", "RolloutManager", "EngineCore", "raylet", "gcs_server",
                "log_monitor", "dashboard", "runtime_env", "monitor.py"):
        if key in cmd:
            return key
    if "train_rl.py" in cmd:
        return "driver"
    return os.path.basename(proc.name())


class Sampler(threading.Thread):
    """Peak RSS per process after the baseline, and the RSS at the baseline step."""

    def __init__(self, pid, metrics_file):
        super().__init__(daemon=True)
        self.pid, self.metrics_file = pid, metrics_file
        self.names, self.baseline, self.peak, self.last = {}, {}, {}, {}
        self.done = threading.Event()

    def steps_done(self):
        try:
            with open(self.metrics_file) as f:
                return sum(1 for _ in f)
        except OSError:
            return 0

    def run(self):
        while not self.done.is_set():
            try:
                procs = [psutil.Process(self.pid)] + psutil.Process(self.pid).children(recursive=True)
            except psutil.Error:
                return
            at_baseline = self.steps_done() >= BASELINE_STEP + 1
            for p in procs:
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                name = label(p)  # a worker takes its actor's title only once the actor is placed on it
                if name and (p.pid not in self.names or name.endswith("Impl")):
                    self.names[p.pid] = name
                self.last[p.pid] = rss
                if at_baseline:
                    self.baseline.setdefault(p.pid, rss)
                    self.peak[p.pid] = max(self.peak.get(p.pid, 0), rss)
            time.sleep(SAMPLE_EVERY_S)


def listing(folder):
    try:
        return {name: _size(os.path.join(folder, name)) for name in os.listdir(folder)}
    except OSError:
        return {}


def _size(path):
    try:
        if os.path.isdir(path):
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        return os.path.getsize(path)
    except OSError:
        return 0


def main():
    args, extra = parse_args()
    out = os.path.abspath(args.out)
    before = {"/dev/shm": listing("/dev/shm"), tempfile.gettempdir(): listing(tempfile.gettempdir())}
    cmd = [sys.executable, "train_rl.py", "--num-rollout", str(args.steps), "--output-dir", out,
           "--save", os.path.join(out, "save"), "--save-interval", "50", "--save-keep", "2", "--progress", "false",
           *extra]
    env = dict(os.environ, WANDB_MODE=os.environ.get("WANDB_MODE", "offline"), WANDB_SILENT="true")
    if os.path.exists(os.path.join(out, "metrics.jsonl")):
        os.remove(os.path.join(out, "metrics.jsonl"))
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid, os.path.join(out, "metrics.jsonl"))
    sampler.start()
    _, stderr = proc.communicate()
    sampler.done.set()
    sampler.join()
    elapsed = time.time() - start
    print(f"train_rl.py: rc {proc.returncode}, {sampler.steps_done()} steps in {elapsed:.0f} s")
    if proc.returncode:
        print(stderr[-3000:])
    report_memory(sampler)
    report_reward(os.path.join(out, "metrics.jsonl"))
    time.sleep(2)  # the processes' own exit handlers
    for folder, was in before.items():
        now = listing(folder)
        new = {k: v for k, v in now.items() if k not in was}
        print(f"{folder}: {len(was)} entries before, {len(now)} after; new: "
              f"{', '.join(f'{k} ({v} B)' for k, v in sorted(new.items())) or 'none'}")
    return proc.returncode


def report_memory(sampler):
    print(f"\n{'process':<18} {'pid':>8} {'RSS @ step ' + str(BASELINE_STEP):>16} {'peak after':>12} {'ratio':>7}")
    worst = 0.0
    for pid, base in sorted(sampler.baseline.items(), key=lambda kv: -kv[1]):
        if base < 50 * 2**20:  # Ray's small helpers: noise, not the run's memory
            continue
        ratio = sampler.peak[pid] / base
        worst = max(worst, ratio)
        print(f"{sampler.names[pid]:<18} {pid:>8} {base / 2**30:>13.3f} GB {sampler.peak[pid] / 2**30:>9.3f} GB "
              f"{ratio:>7.3f}")
    print(f"largest peak / step-{BASELINE_STEP} ratio over processes of >= 50 MB: {worst:.3f} (a leak shows as growth past 1.10)")


def report_reward(metrics_file):
    try:
        rows = [json.loads(x) for x in open(metrics_file)]
    except OSError:
        return
    if rows:
        nan = sum(1 for r in rows for v in r.values() if isinstance(v, float) and v != v)
        print(f"reward {rows[0].get('rollout/reward', float('nan')):.3f} -> {rows[-1].get('rollout/reward', float('nan')):.3f}"
              f" over {len(rows)} steps; NaN metric values: {nan}")


if __name__ == "__main__":
    sys.exit(main())
