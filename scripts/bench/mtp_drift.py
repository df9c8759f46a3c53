#!/usr/bin/env python
"""Drift benchmark: online-trained MTP draft vs frozen MTP draft vs no speculation, one RL run each.

    python scripts/bench/mtp_drift.py            # default size (about 3 minutes on 2 cores)
    python scripts/bench/mtp_drift.py --full     # longer run
    python scripts/bench/mtp_drift.py --num-speculative-tokens 3 \
        --arms online,online:loss=soft_ce,online:loss=tv,frozen   # the draft losses
    python scripts/bench/mtp_drift.py --out runs/mtp_drift_vllm \
        --arms none:backend=vllm,online:backend=vllm:sync_draft=false,online:backend=vllm   # on vLLM

The three arms start from the same pretrained tiny model, seed and prompts and run the same
RL steps (train_rl.py with configs/experiment/drift_{online,frozen,none}.yaml). Per step it
records acceptance length and per-position acceptance, rollout tokens/s, tokens per target
forward, reward, response length and MTP loss; writes drift.csv and drift.png in --out, and
prints start/end figures (rollout wall time per step, what RL waits for, beside tokens/s), the
end ratios online/frozen and online/none, and at how many steps online took no longer than
none. `--spec-adaptive` runs the speculative arms with k chosen per batch size; `--time-plain` has each
speculative arm also decode every batch without drafts, back to back in the same worker, and
prints that paired speedup per step (free of the drift between arms run minutes apart); the
none arm then pairs plain with plain, the control that shows the paired figure's own noise. Speculation is
exact, so at step 0 (same weights everywhere) the arms' rewards must agree within noise; the
script checks and says so. With strict verification (the default rejection_sample_method) the
embedded engine's speculative sampling reproduces plain sampling token for token, and the MTP
loss never reaches the policy, so the arms roll out the same responses step after step until a
rare fp32 rounding flip parts them: their rollout times then compare the same work; the script
counts those steps.
Extra arguments after `--` go to every train_rl.py run.

An arm is `online`, `frozen` or `none`, optionally followed by `:key=value` options
(ARM_OPTIONS): `loss` (--mtp-loss-type), `topk` (--mtp-distill-topk), `layers`
(--mtp-num-layers), `depths` (--mtp-train-depths), `reuse` (--mtp-reuse-attention), `steps`
(--mtp-steps-per-rollout), `replay` (--mtp-replay-batches), `lr` (--mtp-lr), `ckpt` (--hf-checkpoint, e.g. a checkpoint with two MTP layers), `backend`
(--rollout-backend: `online:backend=vllm`) and `sync_draft` (--sync-draft-weights: `false` syncs only
the target, the draft goes stale). With
`--curves` a second PNG shows the per-position acceptance of every arm over the run.
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
# arm options: "online:loss=tv:layers=2" appends these flags last (later flags win in train_rl.py)
ARM_OPTIONS = {"loss": "--mtp-loss-type", "topk": "--mtp-distill-topk", "layers": "--mtp-num-layers", "lr": "--mtp-lr",
               "depths": "--mtp-train-depths", "reuse": "--mtp-reuse-attention", "steps": "--mtp-steps-per-rollout",
               "replay": "--mtp-replay-batches",
               "ckpt": "--hf-checkpoint", "backend": "--rollout-backend", "sync_draft": "--sync-draft-weights"}
MAX_POSITIONS = 8
COLUMNS = ("arm", "step", "num_samples", "reward", "response_len", "spec_accept_length", "tokens_per_target_forward",
           "spec_accept_rate", *(f"spec_accept_rate_pos_{i}" for i in range(MAX_POSITIONS)),
           "rollout_tokens_per_s", "rollout_time", "mtp_loss", "spec_k_mean", "spec_predicted_speedup",
           "spec_measured_speedup", "rollout_engine_time", "plain_engine_time", "spec_speedup_vs_plain",
           "plain_same_responses")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="RL steps per arm (default 40, --full 100)")
    p.add_argument("--full", action="store_true")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "mtp_drift"))
    p.add_argument("--num-speculative-tokens", type=int, default=2)
    p.add_argument("--window", type=int, default=5, help="steps averaged for the start and end figures")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms, each NAME[:key=value...]")
    p.add_argument("--curves", default=None, help="also write the per-position acceptance PNG here")
    p.add_argument("--reuse", action="store_true",
                   help="an arm whose --out directory already holds all --steps steps is read, not rerun")
    p.add_argument("--spec-adaptive", action="store_true", help="k per batch size from a start-up cost profile and the measured acceptance")
    p.add_argument("--time-plain", action="store_true",
                   help="speculative arms also decode each batch without drafts, back to back "
                        "(--rollout-time-plain-baseline): a paired speedup per step")
    p.add_argument("extra", nargs="*", help="after --: passed to train_rl.py")
    args = p.parse_args()
    args.steps = args.steps or (100 if args.full else 40)
    return args


def user_error(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def arm_flags(arm):
    """(base arm, its flags, option flags) of an arm spec such as 'online:loss=soft_ce:layers=2'."""
    base, *options = arm.split(":")
    if base not in ARM_FLAGS:
        user_error(f"--arms {arm!r}: the arm must start with one of {', '.join(ARM_FLAGS)}")
    flags = []
    for option in options:
        key, _, value = option.partition("=")
        if key not in ARM_OPTIONS or not value:
            user_error(f"--arms {arm!r}: options are key=value with key in {', '.join(ARM_OPTIONS)}")
        flags += [ARM_OPTIONS[key], value]
    return base, ARM_FLAGS[base], flags


def arm_label(arm):
    """The arm with checkpoint paths shortened to their directory name (tables, legends)."""
    return ":".join(os.path.basename(o.rstrip("/")) if o.startswith("ckpt=") else o for o in arm.split(":"))


def arm_dir(arm):
    return arm.replace(":", "_").replace("=", "-").replace("/", "_")


def read_metrics(out):
    path = os.path.join(out, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.isfile(path) else []


def run_arm(arm, args):
    base, flags, options = arm_flags(arm)
    out = os.path.join(args.out, arm_dir(arm))
    if args.reuse and len(read_metrics(out)) == args.steps:
        print(f"[drift] {arm}: reusing {out}", flush=True)
        return read_metrics(out)
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens})
    cmd = [sys.executable, os.path.join(REPO, "train_rl.py"), f"experiment=drift_{base}", "--num-rollout", str(args.steps),
           "--output-dir", out, "--progress", "false", "--wandb-group", "mtp_drift", *flags]
    if base != "none":
        cmd += ["--vllm-speculative-config", spec] + (["--spec-adaptive"] if args.spec_adaptive else [])
    # on the none arm the paired pass decodes plain twice: the A/A control of the paired figure
    cmd += ["--rollout-time-plain-baseline"] if args.time_plain else []
    cmd += args.extra + options  # an arm's own options win over the shared extra arguments
    print(f"[drift] {arm}: {' '.join(cmd[1:])}", flush=True)
    env = dict(os.environ, WANDB_SILENT="true")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"[drift] arm {arm} failed:\n{proc.stderr[-3000:]}")
    return read_metrics(out)


def rollout_wall(m):
    """(rollout wall seconds, tokens/s) of the speculative call alone: with --time-plain the worker
    also decoded the batch without drafts inside the same rollout, which is taken out here."""
    seconds, tokens = m["perf/rollout_time"], m["perf/rollout_tokens_per_s"] * m["perf/rollout_time"]
    seconds -= m.get("perf/rollout_plain_engine_time", 0.0)
    return seconds, tokens / max(seconds, 1e-9)


def row(arm, m):
    accept_len = m.get("rollout/spec_accept_length") or 1.0  # no speculation: one token per forward
    rollout_time, tokens_per_s = rollout_wall(m)
    return {"arm": arm, "step": m["rollout/step"], "reward": m["rollout/reward"],
            "response_len": m["rollout/response_len"], "spec_accept_length": accept_len,
            "tokens_per_target_forward": accept_len, "spec_accept_rate": m.get("rollout/spec_accept_rate", 0.0),
            **{f"spec_accept_rate_pos_{i}": m.get(f"rollout/spec_accept_rate_pos_{i}", "") for i in range(MAX_POSITIONS)},
            "rollout_tokens_per_s": tokens_per_s, "rollout_time": rollout_time,
            "mtp_loss": m.get("train/mtp_loss", ""), "num_samples": m["rollout/num_samples"],
            **{k: m.get(f"rollout/{k}", "") for k in ("spec_k_mean", "spec_predicted_speedup", "spec_measured_speedup")},
            "rollout_engine_time": m.get("perf/rollout_engine_time", ""),
            "plain_engine_time": m.get("perf/rollout_plain_engine_time", ""),
            "spec_speedup_vs_plain": m.get("perf/spec_speedup_vs_plain", ""),
            "plain_same_responses": m.get("rollout/plain_same_responses", "")}


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def window(rows, key, first, size):
    """Mean of `key` over the first or last `size` steps, over the steps that have it (an
    adaptive-k step that drafted nothing at a position has no acceptance there)."""
    part = rows[:size] if first else rows[-size:]
    return mean([r[key] for r in part if r[key] != ""])


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


def plot_position_curves(rows_by_arm, k, path):
    """Acceptance at draft positions 1..k and reward over the run, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [f"spec_accept_rate_pos_{i}" for i in range(k)] + ["spec_accept_length", "reward"]
    titles = [f"acceptance at draft position {i + 1}" for i in range(k)] + ["tokens per verify", "reward"]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8))
    for ax, key, title in zip(axes, keys, titles):
        for arm, rows in rows_by_arm.items():
            if rows and rows[0][key] != "":
                ax.plot([r["step"] for r in rows], [r[key] for r in rows], label=arm)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def print_end_table(rows_by_arm, k, size):
    """Per arm: tokens per verify, acceptance at positions 1..k, tokens/s (and / frozen), reward."""
    stats, _ = reward_agreement(rows_by_arm, size)
    frozen = rows_by_arm.get("frozen")
    frozen_tps = window(frozen, "rollout_tokens_per_s", False, size) if frozen else None
    pos_head = " ".join(f"{'acc@' + str(i + 1):>6}" for i in range(k))
    print(f"\n{'arm (end = last ' + str(size) + ' steps)':<34} {'tok/verify':>10} {pos_head} {'tok/s':>7} "
          f"{'/frozen':>7} {'reward':>13}")
    for arm, rows in rows_by_arm.items():
        spec = rows[0]["spec_accept_rate_pos_0"] != ""
        pos = " ".join(f"{window(rows, f'spec_accept_rate_pos_{i}', False, size):>6.3f}" if spec else f"{'-':>6}"
                       for i in range(k))
        tps = window(rows, "rollout_tokens_per_s", False, size)
        ratio = f"{tps / frozen_tps:>6.2f}x" if frozen_tps else f"{'-':>7}"
        p, se = stats[arm]
        print(f"{arm:<34} {window(rows, 'spec_accept_length', False, size):>10.3f} {pos} {tps:>7.0f} {ratio} "
              f"{p:>7.3f}±{se:.3f}")


def reward_stats(rows):
    """(mean reward, binomial standard error) over `rows`."""
    p = mean([r["reward"] for r in rows])
    samples = sum(r["num_samples"] for r in rows)
    return p, math.sqrt(max(p * (1 - p), 1e-12) / samples)


def within_3_se(stats):
    arms = list(stats)
    return all(abs(stats[a][0] - stats[b][0]) <= 3 * math.hypot(stats[a][1], stats[b][1])
               for i, a in enumerate(arms) for b in arms[i + 1:])


def reward_agreement(rows_by_arm, size):
    """End-window reward per arm, and whether the step-0 rewards agree within 3 SE.

    Only step 0 compares like with like: every arm samples from the same weights there, so exact
    speculation must give the same reward distribution. From step 1 on each arm trains on its own
    samples and the RL trajectories part (a second seed of one arm spreads as far), so end rewards
    are reported, not tested."""
    end = {arm: reward_stats(rows[-size:]) for arm, rows in rows_by_arm.items()}
    return end, within_3_se({arm: reward_stats(rows[:1]) for arm, rows in rows_by_arm.items()})


def backend_groups(rows_by_arm):
    """{backend: {base arm: label}}: the online/frozen/none comparisons are made within one backend
    (the first arm of each base counts)."""
    groups = {}
    for label in rows_by_arm:
        base, *options = label.split(":")
        backend = dict(o.partition("=")[::2] for o in options).get("backend", "embedded")
        groups.setdefault(backend, {}).setdefault(base, label)
    return groups


def print_comparisons(backend, arms, rows_by_arm, w):
    """Online vs none step by step, end ratios online/frozen and online/none, online's floor."""
    print(f"-- {backend}: " + ", ".join(f"{base} = {label}" for base, label in arms.items()))
    if "online" in arms and "none" in arms:
        pairs = list(zip(rows_by_arm[arms["online"]], rows_by_arm[arms["none"]]))
        slower = [(o["step"], o["rollout_time"] / n["rollout_time"]) for o, n in pairs if o["rollout_time"] > n["rollout_time"]]
        worst = max((o["rollout_time"] / n["rollout_time"] for o, n in pairs), default=float("nan"))
        print(f"rollout wall time per step, online <= none at {len(pairs) - len(slower)} of {len(pairs)} steps "
              f"(worst online/none {worst:.2f}x" + (f", slower at steps {[s for s, _ in slower]})" if slower else ")"))
        same = sum(o["reward"] == n["reward"] and o["response_len"] == n["response_len"] for o, n in pairs)
        print(f"same rollouts as none (reward and response length equal) at {same} of {len(pairs)} steps: "
              "strict verification reproduces plain sampling, so there the two arms timed the same work")
    end = {base: {k: window(rows_by_arm[label], k, False, w) for k in ("rollout_tokens_per_s", "spec_accept_length")}
           for base, label in arms.items()}
    for other in ("frozen", "none"):
        if "online" in end and other in end:
            print(f"end ratio online/{other}: rollout tokens/s {end['online']['rollout_tokens_per_s'] / end[other]['rollout_tokens_per_s']:.2f}x, "
                  f"acceptance length {end['online']['spec_accept_length'] / end[other]['spec_accept_length']:.2f}x")
    if "online" in arms:
        online = rows_by_arm[arms["online"]]
        floor = online[0]["spec_accept_length"]
        print(f"online acceptance length never below its step-0 value ({floor:.3f}): "
              f"{all(r['spec_accept_length'] >= floor for r in online)} (min {min(r['spec_accept_length'] for r in online):.3f})")


def print_paired(arm, rows, w):
    """--time-plain: the arm's engine time against plain decoding of the same batch, step by step."""
    paired = [r for r in rows if r["spec_speedup_vs_plain"] != ""]
    if not paired:
        return
    speedups = [r["spec_speedup_vs_plain"] for r in paired]
    slower = [r["step"] for r in paired if r["spec_speedup_vs_plain"] < 1]
    print(f"{arm}: paired with plain decoding of the same batch (back to back, same weights): engine time <= plain "
          f"at {len(paired) - len(slower)} of {len(paired)} steps" + (f" (slower at {slower})" if slower else "")
          + f"; speedup start {window(paired, 'spec_speedup_vs_plain', True, w):.2f}x end "
          f"{window(paired, 'spec_speedup_vs_plain', False, w):.2f}x, min {min(speedups):.2f}x; "
          f"whole run {sum(r['plain_engine_time'] for r in paired) / sum(r['rollout_engine_time'] for r in paired):.2f}x; "
          f"plain reproduced {mean([r['plain_same_responses'] for r in paired]):.3f} of the samples")


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows_by_arm = {arm_label(arm): [row(arm_label(arm), m) for m in run_arm(arm, args)] for arm in args.arms.split(",")}
    with open(os.path.join(args.out, "drift.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for rows in rows_by_arm.values():
            writer.writerows(rows)
    plot(rows_by_arm, os.path.join(args.out, "drift.png"))
    w = args.window
    if args.curves:
        plot_position_curves(rows_by_arm, args.num_speculative_tokens, args.curves)
        print(f"wrote {args.curves}")
    print_end_table(rows_by_arm, args.num_speculative_tokens, w)
    print(f"\n{'arm':<34} {'accept_len start':>16} {'accept_len end':>15} {'tok/s start':>12} {'tok/s end':>10} "
          f"{'step s start':>13} {'step s end':>11} {'resp len end':>13} {'reward start':>13} {'reward end':>11}")
    for arm, rows in rows_by_arm.items():
        print(f"{arm:<34} {window(rows, 'spec_accept_length', True, w):>16.3f} {window(rows, 'spec_accept_length', False, w):>15.3f} "
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
    for backend, arms in backend_groups(rows_by_arm).items():
        print_comparisons(backend, arms, rows_by_arm, w)
    for arm, rows in rows_by_arm.items():
        print_paired(arm, rows, w)
    stats, ok = reward_agreement(rows_by_arm, w)
    print("end reward (mean over last steps ± SE): " + ", ".join(f"{a} {p:.3f}±{se:.3f}" for a, (p, se) in stats.items()))
    print("step-0 rewards (same weights in every arm) agree within 3 SE: "
          + ("yes" if ok else "NO — speculation should not change what is sampled"))
    print(f"wrote {os.path.join(args.out, 'drift.csv')} and {os.path.join(args.out, 'drift.png')}")


if __name__ == "__main__":
    main()
