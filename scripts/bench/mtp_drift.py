#!/usr/bin/env python
"""Drift benchmark: online-trained MTP draft vs frozen MTP draft vs no speculation, one RL run each.

    python scripts/bench/mtp_drift.py            # default size (about 3 minutes on 2 cores)
    python scripts/bench/mtp_drift.py --full     # longer run

The three arms start from the same pretrained tiny model, seed and prompts and run the same
RL steps (train_rl.py with configs/experiment/drift_{online,frozen,none}.yaml). Per step it
records acceptance length and per-position acceptance, rollout tokens/s, tokens per target
forward, reward, response length and MTP loss; writes drift.csv and drift.png in --out, and
prints start/end figures (rollout wall time per step, what RL waits for, beside tokens/s), the
end ratios online/frozen and online/none, and at how many steps online took no longer than
none. `--spec-adaptive` runs the speculative arms with k chosen per step. Speculation is
exact, so the arms' rewards must agree within noise; the script checks and says so.
Extra arguments after `--` go to every train_rl.py run.
"""
import argparse
import csv
import json
import math
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARMS = ("online", "frozen", "none")
ARM_FLAGS = {"online": ["--enable-mtp-training", "--mtp-num-layers", "1"], "frozen": [], "none": []}
COLUMNS = ("arm", "step", "num_samples", "reward", "response_len", "spec_accept_length", "tokens_per_target_forward",
           "spec_accept_rate", "spec_accept_rate_pos_0", "spec_accept_rate_pos_1", "spec_accept_rate_pos_2",
           "rollout_tokens_per_s", "rollout_time", "mtp_loss", "spec_k_mean", "spec_predicted_speedup",
           "spec_measured_speedup")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="RL steps per arm (default 40, --full 100)")
    p.add_argument("--full", action="store_true")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "mtp_drift"))
    p.add_argument("--num-speculative-tokens", type=int, default=2)
    p.add_argument("--window", type=int, default=5, help="steps averaged for the start and end figures")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--spec-adaptive", action="store_true", help="k per step from measured cost and acceptance")
    p.add_argument("extra", nargs="*", help="after --: passed to train_rl.py")
    args = p.parse_args()
    args.steps = args.steps or (100 if args.full else 40)
    return args


def run_arm(arm, args):
    out = os.path.join(args.out, arm)
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens})
    cmd = [sys.executable, os.path.join(REPO, "train_rl.py"), f"experiment=drift_{arm}", "--num-rollout", str(args.steps),
           "--output-dir", out, "--progress", "false", "--wandb-group", "mtp_drift", *ARM_FLAGS[arm]]
    if arm != "none":
        cmd += ["--vllm-speculative-config", spec] + (["--spec-adaptive"] if args.spec_adaptive else [])
    cmd += args.extra
    print(f"[drift] {arm}: {' '.join(cmd[1:])}", flush=True)
    env = dict(os.environ, WANDB_SILENT="true", RAY_AUTH_MODE="disabled")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"[drift] arm {arm} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def row(arm, m):
    accept_len = m.get("rollout/spec_accept_length") or 1.0  # no speculation: one token per forward
    return {"arm": arm, "step": m["rollout/step"], "reward": m["rollout/reward"],
            "response_len": m["rollout/response_len"], "spec_accept_length": accept_len,
            "tokens_per_target_forward": accept_len, "spec_accept_rate": m.get("rollout/spec_accept_rate", 0.0),
            **{f"spec_accept_rate_pos_{i}": m.get(f"rollout/spec_accept_rate_pos_{i}", "") for i in range(3)},
            "rollout_tokens_per_s": m["perf/rollout_tokens_per_s"], "rollout_time": m["perf/rollout_time"],
            "mtp_loss": m.get("train/mtp_loss", ""), "num_samples": m["rollout/num_samples"],
            **{k: m.get(f"rollout/{k}", "") for k in ("spec_k_mean", "spec_predicted_speedup", "spec_measured_speedup")}}


def mean(xs):
    return sum(xs) / len(xs)


def window(rows, key, first, size):
    part = rows[:size] if first else rows[-size:]
    return mean([r[key] for r in part])


def plot(rows_by_arm, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("reward", "spec_accept_length", "rollout_tokens_per_s", "response_len")
    fig, axes = plt.subplots(1, len(keys), figsize=(18, 3.8))
    for ax, key in zip(axes, keys):
        for arm, rows in rows_by_arm.items():
            ax.plot([r["step"] for r in rows], [r[key] for r in rows], label=arm)
        ax.set_title(key)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def reward_agreement(rows_by_arm, size):
    """Mean reward over the last `size` steps per arm, and whether every pair agrees within 3 SE."""
    stats = {}
    for arm, rows in rows_by_arm.items():
        p = window(rows, "reward", False, size)
        samples = sum(r["num_samples"] for r in rows[-size:])
        stats[arm] = (p, math.sqrt(max(p * (1 - p), 1e-12) / samples))
    arms = list(stats)
    ok = all(abs(stats[a][0] - stats[b][0]) <= 3 * math.hypot(stats[a][1], stats[b][1])
             for i, a in enumerate(arms) for b in arms[i + 1:])
    return stats, ok


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows_by_arm = {arm: [row(arm, m) for m in run_arm(arm, args)] for arm in args.arms.split(",")}
    with open(os.path.join(args.out, "drift.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for rows in rows_by_arm.values():
            writer.writerows(rows)
    plot(rows_by_arm, os.path.join(args.out, "drift.png"))
    w = args.window
    print(f"\n{'arm':<8} {'accept_len start':>16} {'accept_len end':>15} {'tok/s start':>12} {'tok/s end':>10} "
          f"{'step s start':>13} {'step s end':>11} {'resp len end':>13} {'reward start':>13} {'reward end':>11}")
    for arm, rows in rows_by_arm.items():
        print(f"{arm:<8} {window(rows, 'spec_accept_length', True, w):>16.3f} {window(rows, 'spec_accept_length', False, w):>15.3f} "
              f"{window(rows, 'rollout_tokens_per_s', True, w):>12.0f} {window(rows, 'rollout_tokens_per_s', False, w):>10.0f} "
              f"{window(rows, 'rollout_time', True, w):>13.3f} {window(rows, 'rollout_time', False, w):>11.3f} "
              f"{window(rows, 'response_len', False, w):>13.1f} "
              f"{window(rows, 'reward', True, w):>13.3f} {window(rows, 'reward', False, w):>11.3f}")
    for arm, rows in rows_by_arm.items():
        if rows[-1]["spec_k_mean"] != "":
            print(f"{arm}: adaptive k mean start {window(rows, 'spec_k_mean', True, w):.2f} end "
                  f"{window(rows, 'spec_k_mean', False, w):.2f}; speedup vs plain at end predicted "
                  f"{window(rows, 'spec_predicted_speedup', False, w):.2f}x measured "
                  f"{window(rows, 'spec_measured_speedup', False, w):.2f}x")
    if "online" in rows_by_arm and "none" in rows_by_arm:
        pairs = list(zip(rows_by_arm["online"], rows_by_arm["none"]))
        slower = [(o["step"], o["rollout_time"] / n["rollout_time"]) for o, n in pairs if o["rollout_time"] > n["rollout_time"]]
        worst = max((o["rollout_time"] / n["rollout_time"] for o, n in pairs), default=float("nan"))
        print(f"rollout wall time per step, online <= none at {len(pairs) - len(slower)} of {len(pairs)} steps "
              f"(worst online/none {worst:.2f}x" + (f", slower at steps {[s for s, _ in slower]})" if slower else ")"))
    end = {arm: {k: window(rows, k, False, w) for k in ("rollout_tokens_per_s", "spec_accept_length")}
           for arm, rows in rows_by_arm.items()}
    for other in ("frozen", "none"):
        if "online" in end and other in end:
            print(f"end ratio online/{other}: rollout tokens/s {end['online']['rollout_tokens_per_s'] / end[other]['rollout_tokens_per_s']:.2f}x, "
                  f"acceptance length {end['online']['spec_accept_length'] / end[other]['spec_accept_length']:.2f}x")
    if "online" in rows_by_arm:
        online = rows_by_arm["online"]
        floor = online[0]["spec_accept_length"]
        print(f"online acceptance length never below its step-0 value ({floor:.3f}): "
              f"{all(r['spec_accept_length'] >= floor for r in online)} (min {min(r['spec_accept_length'] for r in online):.3f})")
    stats, ok = reward_agreement(rows_by_arm, w)
    print("end reward (mean over last steps ± SE): " + ", ".join(f"{a} {p:.3f}±{se:.3f}" for a, (p, se) in stats.items()))
    print("rewards agree within noise (3 SE): " + ("yes" if ok else "NO — speculation should not change rewards"))
    print(f"wrote {os.path.join(args.out, 'drift.csv')} and {os.path.join(args.out, 'drift.png')}")


if __name__ == "__main__":
    main()
