"""train_rl.py on a two-node Ray cluster started on this host (both nodes with token auth): the
rollout engines placed on one node and the trainer on the other through their custom resources,
weights synced across the nodes every step and checked; then one node's raylet is killed mid-run.

Placement that cannot fit any cluster is one line, exit 2, and never a wait (checked on a local Ray)."""
import json
import os
import subprocess
import sys
import time

import pytest

from tests.test_bad_inputs import args_for, ckpt, refused  # noqa: F401  (module fixture reused)
from tests.test_train_rl import REPO, run_train
from vime.config import DEFAULT_TINY_MODEL

STEPS, WINDOW = 12, 4
ROLLOUT, TRAINER = "rollout_node", "trainer_node"


def train_cmd(cluster, out, steps, *extra):
    return [sys.executable, "train_rl.py", "--ray-address", cluster.address, "--hf-checkpoint", DEFAULT_TINY_MODEL,
            "--num-rollout", str(steps), "--output-dir", str(out), "--progress", "false", "--use-wandb", "false",
            "--enable-mtp-training", "--mtp-num-layers", "1", "--rollout-num-workers", "2",
            "--rollout-resources", json.dumps({ROLLOUT: 1}), "--actor-resources", json.dumps({TRAINER: 1}),
            "--check-weight-update-equal", *map(str, extra)]


def rows_of(out):
    path = os.path.join(out, "metrics.jsonl")
    return [json.loads(x) for x in open(path)] if os.path.isfile(path) else []


def mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


@pytest.fixture(scope="module")
def cluster():
    from tests.two_node_cluster import TwoNodeCluster

    c = TwoNodeCluster({ROLLOUT: 4}, {TRAINER: 4})
    yield c
    c.stop()


def actors_by_node(cluster):
    """{class name: {node's custom resource label, ...}} from Ray's state API (the dashboard's)."""
    code = f"""
import json, ray
from ray.util.state import list_actors
ray.init(address={cluster.address!r}, log_to_driver=False)
labels = {{n["NodeID"]: sorted(k for k in n["Resources"] if k in ({ROLLOUT!r}, {TRAINER!r})) for n in ray.nodes()}}
out = {{}}
for a in list_actors(address={cluster.address!r}, limit=1000, detail=True):
    out.setdefault(a.class_name, []).extend(labels.get(a.node_id, []))
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], env=cluster.env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {k: set(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["embedded", "vllm"])
def test_rollout_on_one_node_trainer_on_the_other_learns_and_syncs_every_step(cluster, tmp_path, backend):
    if backend == "vllm":
        pytest.importorskip("vllm")
    proc = subprocess.run(train_cmd(cluster, tmp_path, STEPS, "--rollout-backend", backend), cwd=REPO,
                          env=cluster.env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]  # --check-weight-update-equal: every tensor, every step
    rows = rows_of(tmp_path)
    assert [r["rollout/step"] for r in rows] == list(range(STEPS))
    assert all(r["rollout/weight_version_synced"] == r["rollout/step"] + 1 for r in rows)
    first, last = rows[:WINDOW], rows[-WINDOW:]
    assert mean(last, "rollout/reward") > mean(first, "rollout/reward")
    assert mean(last, "rollout/spec_accept_length") > mean(first, "rollout/spec_accept_length")
    where = actors_by_node(cluster)
    assert where["RolloutWorkerImpl"] == {ROLLOUT} and where["TrainerActorImpl"] == {TRAINER}


@pytest.mark.slow
def test_losing_the_trainer_node_ends_the_run_with_one_line_naming_it_and_the_checkpoint(cluster, tmp_path):
    out, save = tmp_path / "out", tmp_path / "save"
    proc = subprocess.Popen(train_cmd(cluster, out, 40, "--save", save, "--save-interval", 2), cwd=REPO,
                            env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600
        while len(rows_of(out)) < 3 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        cluster.node_raylet().kill()
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: node ") and TRAINER in line and "was lost at step" in line, err[-3000:]
    assert f"--load {save}" in line and "last checkpoint: step" in line


# ------------------------------------------------------------------ bad placement (one line, exit 2)
@pytest.mark.parametrize("extra, needles", [
    (["--colocate", "--rollout-num-workers", 2], ["--colocate", "--rollout-num-workers 2", "1 trainer ranks"]),
    (["--colocate", "--async-rollout"], ["--colocate", "--async-rollout"]),
    (["--colocate", "--debug-rollout-only"], ["--colocate", "debug"]),
    (["--actor-num-nodes", 2], ["--actor-num-nodes 2", "1 trainer ranks"]),
    (["--rollout-resources", "{oops"], ["--rollout-resources", "not JSON"]),
    (["--actor-resources", '{"CPU": 2}'], ["--actor-resources", "own flags"]),
    (["--placement-timeout", 0], ["--placement-timeout"]),
])
def test_layouts_that_cannot_be_placed_are_refused_before_ray_starts(ckpt, tmp_path, extra, needles):  # noqa: F811
    refused(args_for(ckpt, tmp_path, *extra), *needles)


@pytest.mark.parametrize("extra, missing", [
    (["--rollout-resources", json.dumps({ROLLOUT: 1})], f"1 {ROLLOUT} (free: 0)"),
    pytest.param(["--actor-num-gpus-per-node", 1], "1 GPU (free: 0)", marks=pytest.mark.slow),  # same path, GPUs
])
def test_placement_that_does_not_fit_the_cluster_is_one_line_and_no_wait(ckpt, tmp_path, extra, missing):  # noqa: F811
    start = time.time()
    proc = run_train(*args_for(ckpt, tmp_path, "--placement-timeout", 600, *extra), timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: the run's placement needs ") and missing in proc.stderr
    assert time.time() - start < 300  # far from --placement-timeout: checked, not waited for


def test_nccl_weight_transfer_on_a_cluster_without_gpus_is_one_line(ckpt, tmp_path):  # noqa: F811
    pytest.importorskip("vllm")
    proc = run_train(*args_for(ckpt, tmp_path, "--rollout-backend", "vllm", "--vllm-weight-transfer", "nccl"),
                     timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: --vllm-weight-transfer nccl moves weights between GPUs")
    assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))  # refused before any actor started
