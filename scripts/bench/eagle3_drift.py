#!/usr/bin/env python
"""Drift benchmark for an external EAGLE-3 draft: online-trained vs frozen draft vs no speculation.

    python scripts/bench/eagle3_drift.py                         # both backends, 40 RL steps, k = 3
    python scripts/bench/eagle3_drift.py --backends embedded --steps 20 --reuse

Every arm is one train_rl.py run on the same target (checkpoints/tiny-qwen2), seed and prompts:
`none` rolls out without speculation, `frozen` drafts with the shipped draft
(checkpoints/tiny-qwen2-eagle3), which RL never updates, so its acceptance shows how far the policy
drifts away from it, and `online` drafts with the same draft trained every step
(--enable-draft-training, the draft flags at their defaults unless given after `--`) and synced
to the rollout. `--draft-warmup-steps N` starts the frozen and online arms from a draft made with
a shorter offline warm-up instead (the same draft for both). Writes eagle3_drift.csv and the
acceptance-length curves (PNG) in --out and prints, per backend, start/end acceptance length and
tokens/s of each arm, the end ratio online/frozen, and the rewards at step 0 (the same weights
everywhere: exact speculation must agree within noise). `--reuse` keeps arms already run to
--steps in --out. vLLM counts drafts
accepted past a request's end too (tests/test_vllm_eagle3.py), so its acceptance reads higher
than the embedded engine's on this task's short answers; compare arms within one backend.
Extra arguments after `--` go to every train_rl.py run.
"""
import argparse
import csv
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from scripts.bench.mtp_drift import read_metrics, reward_agreement, row, window  # noqa: E402

TARGET = os.path.join(REPO, "checkpoints", "tiny-qwen2")
DRAFT = os.path.join(REPO, "checkpoints", "tiny-qwen2-eagle3")
ARMS = ("none", "frozen", "online")
BACKENDS = ("embedded", "vllm")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--out", default=os.path.join(REPO, "runs", "eagle3_drift"))
    p.add_argument("--png", default=None, help="acceptance-length curves (default: OUT/eagle3_drift.png)")
    p.add_argument("--window", type=int, default=5, help="steps averaged for the start and end figures")
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--draft-warmup-steps", type=int, default=None,
                   help="start the frozen and online arms from a draft made here with this many offline warm-up "
                        "steps (scripts/make_eagle3_draft.py) instead of --draft")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--reuse", action="store_true", help="keep arms already run to --steps in --out")
    p.add_argument("extra", nargs="*", help="after --: passed to train_rl.py")
    return p.parse_args()


def make_draft(args):
    """--draft-warmup-steps N: a draft of the target warmed up for N steps (made once into --out)."""
    out = os.path.join(args.out, f"draft_warmup{args.draft_warmup_steps}")
    if not os.path.isfile(os.path.join(out, "config.json")):
        cmd = [sys.executable, os.path.join(REPO, "scripts", "make_eagle3_draft.py"), "--target", TARGET, "--out", out,
               "--warmup-steps", str(args.draft_warmup_steps)]
        print(f"[eagle3-drift] draft: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, cwd=REPO, check=True)
    return out


def run_arm(arm, backend, args):
    out = os.path.join(args.out, f"{backend}_{arm}")
    if args.reuse and len(read_metrics(out)) == args.steps:
        print(f"[eagle3-drift] {backend}/{arm}: reusing {out}", flush=True)
        return [row(f"{backend}/{arm}", m) for m in read_metrics(out)]
    spec = {"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.num_speculative_tokens}
    cmd = [sys.executable, os.path.join(REPO, "train_rl.py"), "--hf-checkpoint", TARGET, "--num-rollout",
           str(args.steps), "--output-dir", out, "--progress", "false", "--rollout-backend", backend,
           "--wandb-group", "eagle3_drift"]
    cmd += ["--vllm-speculative-config", "none" if arm == "none" else json.dumps(spec)]
    cmd += ["--enable-draft-training"] if arm == "online" else []
    cmd += args.extra
    print(f"[eagle3-drift] {backend}/{arm}: {' '.join(cmd[1:])}", flush=True)
    env = dict(os.environ, WANDB_SILENT="true", RAY_AUTH_MODE="disabled")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"[eagle3-drift] {backend}/{arm} failed:\n{proc.stderr[-3000:]}")
    return [row(f"{backend}/{arm}", m) for m in read_metrics(out)]


def plot(rows_by_arm, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("spec_accept_length", "reward", "rollout_tokens_per_s")
    titles = ("tokens per verify (acceptance length)", "reward", "rollout tokens/s")
    fig, axes = plt.subplots(1, len(keys), figsize=(15, 3.8))
    for ax, key, title in zip(axes, keys, titles):
        for arm, rows in rows_by_arm.items():
            ax.plot([r["step"] for r in rows], [r[key] for r in rows], label=arm)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    args = parse_args()
    backends = args.backends.split(",")
    arms = args.arms.split(",")
    bad = [b for b in backends if b not in BACKENDS] + [a for a in arms if a not in ARMS]
    if bad:
        print(f"error: --backends / --arms {bad[0]!r}: choose from {', '.join(BACKENDS + ARMS)}", file=sys.stderr)
        sys.exit(2)
    os.makedirs(args.out, exist_ok=True)
    if args.draft_warmup_steps is not None:
        args.draft = make_draft(args)
    rows_by_arm = {f"{b}/{a}": run_arm(a, b, args) for b in backends for a in arms}
    with open(os.path.join(args.out, "eagle3_drift.csv"), "w", newline="") as f:
        rows = [r for rs in rows_by_arm.values() for r in rs]
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    png = args.png or os.path.join(args.out, "eagle3_drift.png")
    plot(rows_by_arm, png)
    w = args.window
    print(f"\n{'arm':<18} {'acc.len start':>13} {'acc.len end':>11} {'tok/s start':>11} {'tok/s end':>9}")
    for arm, rows in rows_by_arm.items():
        print(f"{arm:<18} {window(rows, 'spec_accept_length', True, w):>13.3f} "
              f"{window(rows, 'spec_accept_length', False, w):>11.3f} "
              f"{window(rows, 'rollout_tokens_per_s', True, w):>11.0f} {window(rows, 'rollout_tokens_per_s', False, w):>9.0f}")
    for backend in backends:
        group = {a: rs for a, rs in rows_by_arm.items() if a.startswith(backend + "/")}
        end, agree = reward_agreement(group, w)
        print(f"{backend}: step-0 rewards agree within 3 SE: {agree}; end rewards "
              + ", ".join(f"{a} {p:.3f}±{se:.3f}" for a, (p, se) in end.items()))
        online, frozen = group.get(f"{backend}/online"), group.get(f"{backend}/frozen")
        if online and frozen:
            ratio = window(online, "spec_accept_length", False, w) / window(frozen, "spec_accept_length", False, w)
            print(f"{backend}: acceptance length online / frozen over the last {w} steps: {ratio:.2f}x")
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
