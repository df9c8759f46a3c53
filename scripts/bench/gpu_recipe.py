#!/usr/bin/env python
"""Real acceptance on one GPU: a 112 M model with an MTP layer pretrained on the task, then RL with no
speculation, a frozen and an online MTP draft; the rollout and whole-step speed-ups with the acceptance
the drafts reached.

    python scripts/bench/gpu_recipe.py                        # one GPU, bf16, about 7 minutes
    python scripts/bench/gpu_recipe.py --size tiny --device cpu --pretrain-seconds 20 --steps 3 \\
        -- --rollout-batch-size 4 --n-samples-per-prompt 4 --global-batch-size 16   # the same, tiny, on CPU

1. Pretraining: scripts/make_tiny_model.py at the --size shape (recipe: the spec-scale benchmark's 16
   layers, hidden 768, 112 M parameters, with one MTP layer; tiny: the shipped model's shape) on
   --device for --pretrain-seconds, trunk on both answer formats, the MTP layer on the direct one.
2. RL: the drift benchmark (scripts/bench/rl_arms.py drift --draft mtp, k = 2) on that checkpoint:
   arms none, frozen and online, --steps RL steps each, the same seeds and prompts, one after the other
   on the same device; train_rl.py flags after `--` go to every arm (the recipe size adds --bf16 on a
   GPU and learning rates for its size).
3. The speed-ups over no speculation from the arms' metrics, steps 1.. (step 0 holds the warm-up):
   rollout (perf/rollout_time) and whole step (perf/step_time), each a ratio of means over the same
   steps of runs that sample from the same policy trajectory; the acceptance measured
   (rollout/spec_accept_length, tokens per verify, and by draft position) over the run and its end.
   The last line starts with `recipe:` (scripts/gpu_check.sh prints it).
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from scripts import make_tiny_model  # noqa: E402
from scripts.bench import rl_arms  # noqa: E402
from scripts.bench.lib.arm_runs import REPO, read_metrics  # noqa: E402
from scripts.bench.lib.drift import arm_dir, arm_label  # noqa: E402
from scripts.bench.throughput import SHAPE  # noqa: E402
from vime.errors import exit_on_user_error, require  # noqa: E402

ARMS = ("online", "frozen", "none")
END_WINDOW = 5


def recipe_size(device):
    """The recipe's model and its pretraining and RL settings for its size (a GPU in bf16): (shape,
    pretraining flags, train_rl.py flags of every arm, the online arm's own options)."""
    shape = dict(SHAPE, max_position_embeddings=256)  # the task's prompts and answers fit in 256 positions
    pretrain = ["--batch-size", "128", "--lr", "6e-4"] + (["--bf16"] if device != "cpu" else [])
    rl = (["--bf16"] if device != "cpu" else []) + ["--lr", "3e-5"]
    return shape, pretrain, rl, ":lr=1e-3"  # --draft-lr: only the online arm trains a draft


def tiny_size(device):
    """The shipped tiny model's shape and settings: the recipe at test size."""
    del device
    return {}, [], [], ""


SIZES = {"recipe": recipe_size, "tiny": tiny_size}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="recipe", choices=list(SIZES))
    p.add_argument("--device", default="cuda", help="where pretraining runs (the RL arms find their own device)")
    p.add_argument("--pretrain-seconds", type=float, default=150.0)
    p.add_argument("--steps", type=int, default=40, help="RL steps per arm")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "gpu_recipe"))
    p.add_argument("extra", nargs="*", help="after --: train_rl.py flags for every arm")
    args = p.parse_args(argv)
    require(args.steps >= 2, f"--steps {args.steps}: give at least 2 (step 0 holds the warm-up)")
    require(args.pretrain_seconds > 0, f"--pretrain-seconds {args.pretrain_seconds:g}: give a positive budget")
    if args.device.startswith("cuda"):
        import torch

        require(torch.cuda.is_available(), f"--device {args.device}: torch sees no CUDA device here; "
                "use --size tiny --device cpu for the CPU-sized run")
    return args


def pretrain_stage(args):
    """The recipe's checkpoint in OUT/model; returns (its directory, final lm loss, final MTP loss)."""
    shape, flags, _, _ = SIZES[args.size](args.device)
    out = os.path.join(args.out, "model")
    lm, mtp = make_tiny_model.main(["--out", out, "--steps", "1000000", "--seconds", str(args.pretrain_seconds),
                                    "--device", args.device, "--config-overrides", json.dumps(shape), *flags])
    return out, lm, mtp


def arm_specs(online_options):
    """{arm: its rl_arms.py drift spec}: the online arm with its own options."""
    return {arm: arm + (online_options if arm == "online" else "") for arm in ARMS}


def rl_stage(args, checkpoint):
    """The drift benchmark's three arms on `checkpoint`; {arm: its metrics rows}."""
    _, _, rl_flags, online_options = SIZES[args.size](args.device)
    arms_out = os.path.join(args.out, "arms")
    specs = arm_specs(online_options)
    rl_arms.main(["drift", "--draft", "mtp", "--hf-checkpoint", checkpoint, "--arms", ",".join(specs.values()),
                  "--steps", str(args.steps), "--out", arms_out, "--", *rl_flags, *args.extra])
    return {arm: read_metrics(os.path.join(arms_out, arm_dir(arm_label("embedded", spec)))) for arm, spec in specs.items()}


def mean_after_warmup(rows, key):
    return statistics.fmean(r[key] for r in rows[1:])


def speedups(rows_by_arm):
    """{arm: (rollout speed-up, whole-step speed-up)} over the none arm: ratios of the mean seconds of
    steps 1.. (the same steps in every arm)."""
    none = rows_by_arm["none"]
    return {arm: (mean_after_warmup(none, "perf/rollout_time") / mean_after_warmup(rows, "perf/rollout_time"),
                  mean_after_warmup(none, "perf/step_time") / mean_after_warmup(rows, "perf/step_time"))
            for arm, rows in rows_by_arm.items() if arm != "none"}


def acceptance(rows):
    """(tokens per verify over the run, over its last END_WINDOW steps, acceptance by position at its end)."""
    run = statistics.fmean(r["rollout/spec_accept_length"] for r in rows)
    end_rows = rows[-END_WINDOW:]
    end = statistics.fmean(r["rollout/spec_accept_length"] for r in end_rows)
    positions = []
    for i in range(8):
        values = [r[f"rollout/spec_accept_rate_pos_{i}"] for r in end_rows if f"rollout/spec_accept_rate_pos_{i}" in r]
        if not values:
            break
        positions.append(statistics.fmean(values))
    return run, end, positions


def report(args, rows_by_arm, losses, seconds):
    """The table of speed-ups and acceptance, and the one `recipe:` line."""
    for arm, rows in rows_by_arm.items():
        require(len(rows) == args.steps, f"the {arm} arm logged {len(rows)} of {args.steps} steps; see {args.out}")
    ups = speedups(rows_by_arm)
    print(f"\n{'arm':<8} {'rollout x none':>15} {'step x none':>12} {'tok/verify run':>15} {'end':>6}  by position (end)")
    cells = []
    for arm in ("online", "frozen"):
        run, end, positions = acceptance(rows_by_arm[arm])
        rollout, step = ups[arm]
        print(f"{arm:<8} {rollout:>14.2f}x {step:>11.2f}x {run:>15.3f} {end:>6.3f}  "
              + " / ".join(f"{p:.2f}" for p in positions))
        cells.append(f"{arm} rollout {rollout:.2f}x step {step:.2f}x accept {run:.2f} (end {end:.2f})")
    reward = {arm: statistics.fmean(r["rollout/reward"] for r in rows[-END_WINDOW:]) for arm, rows in rows_by_arm.items()}
    print("end reward: " + ", ".join(f"{arm} {value:.3f}" for arm, value in reward.items()))
    print(f"recipe: {args.size} model on {args.device}, pretrained {args.pretrain_seconds:g} s (lm {losses[0]:.3f}, "
          f"mtp {losses[1]:.3f}); {args.steps} RL steps vs no speculation (steps 1..): " + "; ".join(cells)
          + f"; {seconds:.0f} s in all")


@exit_on_user_error
def main(argv=None):
    start = time.time()
    args = parse_args(argv)
    checkpoint, lm, mtp = pretrain_stage(args)
    rows_by_arm = rl_stage(args, checkpoint)  # an arm that fails ends the recipe with its stderr (arm_runs)
    report(args, rows_by_arm, (lm, mtp), time.time() - start)


if __name__ == "__main__":
    main()
