"""scripts/bench/gpu_recipe.py at tiny size on CPU: the same script that, on one GPU, pretrains a 112 M
model with an MTP layer and compares no speculation, a frozen and an online MTP draft over RL.

- fast: the pretraining stage on its time budget makes a checkpoint train_rl.py's checks accept, whose
  losses fell below a uniform guess's (ln of the vocabulary: the reference a model that learned
  nothing scores);
- slow: the whole recipe, its printed speed-ups and acceptance against the ratios of the arms' own
  metrics (the drift benchmark's metrics.jsonl of each arm)."""
import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest

from tests.test_train_rl import REPO

SMALL_RUN = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
             "--micro-batch-size", "8", "--rollout-max-response-len", "16"]


def test_the_recipes_pretraining_stage_makes_a_checkpoint_that_learned_and_that_a_run_accepts(tmp_path):
    from scripts.bench import gpu_recipe
    from train_rl import prepare
    from vime.cli_config import load_config
    from vime.models.hf_format import read_config

    args = gpu_recipe.parse_args(["--size", "tiny", "--device", "cpu", "--pretrain-seconds", "2", "--out",
                                  str(tmp_path)])
    checkpoint, lm, mtp = gpu_recipe.pretrain_stage(args)
    uniform = math.log(read_config(checkpoint).vocab_size)
    assert lm < uniform and mtp < uniform
    prepare(load_config(["--hf-checkpoint", checkpoint, "--enable-mtp-training", "--mtp-num-layers", "1",
                         "--output-dir", str(tmp_path / "run")]))


def test_every_arm_of_the_recipe_at_its_gpu_size_passes_train_rls_checks(tmp_path):
    from scripts.bench import gpu_recipe, rl_arms
    from scripts.bench.lib import drift

    _, _, rl_flags, online_options = gpu_recipe.recipe_size("cuda")
    arms = ",".join(gpu_recipe.arm_specs(online_options).values())
    args = rl_arms.parse_args(["drift", "--draft", "mtp", "--arms", arms, "--out", str(tmp_path), "--", *rl_flags])
    planned = drift.plan_arms(args)
    assert {label.split("/")[1].split(":")[0] for _, label, _ in planned} == set(gpu_recipe.ARMS)
    for _, _, flags in planned:
        drift.check_arm_flags(flags)


@pytest.mark.parametrize("draft", [["--draft", "mtp"], ["--draft", "dflash", "--draft-warmup-steps", "5"]],
                         ids=["mtp", "warmed-up-dflash"])
def test_the_drift_bench_refuses_a_flag_one_arm_cannot_take_before_any_arm_runs(tmp_path, draft):
    """--draft-lr given to every arm: the frozen and none arms train no draft, so train_rl.py refuses it;
    the benchmark says so in one line before the first (online) arm starts and before any draft is
    warmed up."""
    proc = subprocess.run([sys.executable, "scripts/bench/rl_arms.py", "drift", *draft, "--arms", "online,frozen,none",
                           "--steps", "2", "--out", str(tmp_path), "--", "--draft-lr", "1e-3"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --draft-lr") and proc.stderr.count("\n") == 1
    assert not any(p.is_dir() for p in tmp_path.iterdir())  # no draft made, no arm ran


def test_the_recipe_refuses_a_gpu_it_does_not_have_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, "scripts/bench/gpu_recipe.py", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --device cuda: torch sees no CUDA device")


@pytest.mark.slow
def test_the_whole_recipe_at_tiny_size_prints_the_speed_ups_its_arms_measured(tmp_path):
    steps = 3
    cmd = [sys.executable, "scripts/bench/gpu_recipe.py", "--size", "tiny", "--device", "cpu", "--pretrain-seconds",
           "10", "--steps", str(steps), "--out", str(tmp_path), "--", *SMALL_RUN]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, RAY_ADDRESS="local"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("recipe: ")][-1]
    rows = {}
    for arm in ("online", "frozen", "none"):
        with open(tmp_path / "arms" / f"embedded_{arm}" / "metrics.jsonl") as f:
            rows[arm] = [json.loads(x) for x in f]
        assert len(rows[arm]) == steps

    def mean(arm, key):
        return statistics.fmean(r[key] for r in rows[arm][1:])

    for arm in ("online", "frozen"):
        rollout = mean("none", "perf/rollout_time") / mean(arm, "perf/rollout_time")
        step = mean("none", "perf/step_time") / mean(arm, "perf/step_time")
        accept = statistics.fmean(r["rollout/spec_accept_length"] for r in rows[arm])
        printed = re.search(rf"{arm} rollout ([0-9.]+)x step ([0-9.]+)x accept ([0-9.]+)", line)
        assert printed, line
        assert [float(x) for x in printed.groups()] == [round(rollout, 2), round(step, 2), round(accept, 2)]


def test_gpu_check_parses_and_on_a_machine_without_cuda_stops_in_one_line():
    import torch

    assert subprocess.run(["bash", "-n", "scripts/gpu_check.sh"], cwd=REPO).returncode == 0
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run")
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    # a checkout holding a GPU bundle (.gpu/, built for the GPU machine's Python) is refused for the bundle
    assert proc.stderr.startswith(("error: scripts/gpu_check.sh needs a CUDA GPU", "error: .gpu/on_device.sh failed"))
