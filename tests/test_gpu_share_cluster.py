"""One GPU shared by a trainer rank and a rollout engine, on a Ray cluster that declares one logical GPU
(`ray start --head --num-gpus 1`, token auth on) on this CPU-only machine: the README's main command
runs unchanged (the cluster has fewer GPUs than ranks + engines, so the rank and the engine are packed
onto the one GPU, half each), and so does the `--colocate` fractional form. Both actors compute on
CPU (each finds its own device; the GPU in Ray's table is logical), see the same Ray GPU, and so take
the weights by the in-place hand-over (shared memory here, CUDA IPC on a GPU); every tensor is checked
after every push (--check-weight-update-equal); a vLLM engine maps them and shares each round on into
vLLM's worker the same way. With memory by turns asked for, the engine gives its KV
cache and weights back while the trainer steps and the trainer keeps its optimizer state on the host
while the engine generates: the pushes bring the weights back and the guard finds them equal. Shares
the one GPU cannot hold are refused in one line (exit 2) before any actor starts."""
import json
import os
import subprocess
import sys

import pytest

from tests.test_train_rl import REPO

STEPS = 3
MAIN_COMMAND = ["--enable-mtp-training", "--mtp-num-layers", "1"]


@pytest.fixture(scope="module")
def one_gpu_cluster():
    from tests.two_node_cluster import TwoNodeCluster

    c = TwoNodeCluster({}, None, cpus=2, gpus=1)
    yield c
    c.stop()


def run_on(cluster, out, *flags):
    cmd = [sys.executable, "train_rl.py", *MAIN_COMMAND, "--ray-address", cluster.address, "--num-rollout", STEPS,
           "--output-dir", out, "--progress", "false", "--no-use-wandb", "--check-weight-update-equal", *flags]
    return subprocess.run(list(map(str, cmd)), cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=1200)


def rows_of(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("flags, packed_line", [
    ((), True),
    (("--colocate", "--actor-num-gpus-per-node", 0.5, "--rollout-num-gpus-per-engine", 0.5), False),
    (("--colocate", "--rollout-release-kv-cache", "true", "--rollout-release-weights", "--offload-optimizer-state"),
     False),
    (("--rollout-backend", "vllm"), True),
], ids=["main-command", "colocate-fractions", "colocate-memory-by-turns", "main-command-vllm"])
def test_a_rank_and_an_engine_share_the_one_gpu_and_hand_weights_over_in_place(one_gpu_cluster, tmp_path, flags,
                                                                                packed_line):
    if "vllm" in flags:
        pytest.importorskip("vllm")
    proc = run_on(one_gpu_cluster, tmp_path, *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]  # every tensor compared after every push
    rows = rows_of(tmp_path)
    assert [r["rollout/step"] for r in rows] == list(range(STEPS))
    assert all(r["rollout/weight_version_synced"] == r["rollout/step"] + 1 for r in rows)
    assert all(r["weight_sync/in_place_engines"] == 1 for r in rows)
    assert ("share a GPU with an engine" in proc.stdout + proc.stderr) == packed_line
    assert all(r["memory/rollout_rss_gib"] > 0 and r["memory/engine_while_training_rss_gib"] > 0 for r in rows)
    from scripts.bench.lib.run_summary import summary  # the line scripts/gpu_check.sh prints of such a run

    assert f"{STEPS} steps" in summary(rows) and "in-place engines 1" in summary(rows)


@pytest.mark.slow
def test_fractions_that_do_not_fit_the_one_gpu_are_refused_in_one_line_before_any_actor_starts(one_gpu_cluster,
                                                                                             tmp_path):
    """A rank of 0.75 GPU and an engine of 0.5 in bundles of their own: 1.25 GPU on a cluster of one."""
    proc = run_on(one_gpu_cluster, tmp_path, "--actor-num-gpus-per-node", 0.75, "--rollout-num-gpus-per-engine", 0.5,
                  "--placement-timeout", 600)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: the run's placement needs 1.25 GPU (free: 1)")
    assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))
