"""Mistakes about the cluster, refused in one line (exit 2) instead of a Ray traceback or a hang.

- A trainer node or rollout engine given no CPUs: Ray refuses the empty placement bundle with a
  ValueError traceback; vime refuses the flag before Ray starts.
- `--ray-address` where no Ray head answers: one line naming the flag, the bounded wait
  (`--ray-connect-timeout`) and what to check, within that wait; never Ray's minutes of C++
  connection retries. A live token-auth head is the control: it passes with its token, and is
  refused (one line) without it."""
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from orchestration.placement import demand_of
from orchestration.ray_connect import check_ray_address
from tests.bad_input_helpers import refused
from tests.test_bad_inputs import args_for, ckpt  # noqa: F401  (ckpt: the bad-input tests' fixture)
from tests.two_node_cluster import TwoNodeCluster, free_port
from vime.cli_config import load_config
from vime.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Slack on top of the timeout for starting the probe's Python on a loaded machine
STARTUP_SLACK_S = 10


@pytest.fixture
def open_port_that_is_not_ray():
    """A port that accepts TCP connections and never speaks (a service other than Ray's GCS)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted = []
    threading.Thread(target=lambda: [accepted.append(server.accept()) for _ in range(8)], daemon=True).start()
    yield server.getsockname()[1]
    server.close()


@pytest.mark.parametrize("flag", ["--rollout-num-cpus-per-engine", "--actor-num-cpus-per-node"])
def test_zero_cpus_for_an_engine_or_a_trainer_node_is_refused_before_ray_sees_an_empty_bundle(ckpt, tmp_path, flag):
    with_zero = args_for(ckpt, tmp_path, flag, 0)
    # what Ray would be handed on a CPU-only cluster: a bundle reserving nothing, which it refuses
    assert {} in [bundle for bundle, _ in demand_of(load_config(with_zero), cluster_gpus=0).bundles()]
    refused(with_zero, f"{flag} 0: must be >= 1", "at least one CPU")
    refused(args_for(ckpt, tmp_path, flag, -1), f"{flag} -1: must be >= 1")


def test_a_ray_address_where_nothing_listens_exits_2_in_one_line_within_the_connect_timeout(ckpt, tmp_path):
    timeout, closed_port = 5, free_port()
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "train_rl.py", *args_for(ckpt, tmp_path, "--ray-address",
                                                                   f"127.0.0.1:{closed_port}", "--ray-connect-timeout",
                                                                   timeout)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert took < 60, took
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for needle in (f"--ray-address 127.0.0.1:{closed_port}", f"--ray-connect-timeout {timeout} s", "ray start --head",
                   "port", "RAY_AUTH_TOKEN"):
        assert needle in errors[0], errors[0]
    assert "Traceback" not in proc.stderr and "Failed to connect to GCS" not in proc.stderr, proc.stderr[-3000:]


def test_an_open_port_that_is_not_a_ray_head_is_refused_when_the_connect_timeout_runs_out(open_port_that_is_not_ray):
    timeout = 3
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        check_ray_address(f"127.0.0.1:{open_port_that_is_not_ray}", timeout)
    took = time.monotonic() - start
    assert timeout <= took + 0.5 and took < timeout + STARTUP_SLACK_S, took
    assert "no Ray head replied within --ray-connect-timeout 3 s" in str(err.value)


@pytest.mark.parametrize("address, needle", [("127.0.0.1", "give the head's host:port"),
                                             ("127.0.0.1:99999", "give the head's host:port"),
                                             ("no-such-host.invalid:6379", "host 'no-such-host.invalid' not found")])
def test_an_address_that_cannot_name_a_ray_head_is_refused_at_once(address, needle):
    start = time.monotonic()
    with pytest.raises(UserError, match=needle):
        check_ray_address(address, 30)
    assert time.monotonic() - start < STARTUP_SLACK_S


@pytest.fixture(scope="module")
def token_head():
    cluster = TwoNodeCluster({"head_node": 1}, None, cpus=1)
    yield cluster
    cluster.stop()


def test_a_live_head_passes_with_its_token_and_is_refused_in_one_line_without_it(token_head, monkeypatch):
    """The control: the check lets through the cluster it guards the run's join of."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", token_head.env["RAY_AUTH_TOKEN"])
    check_ray_address(token_head.address, 30)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 64)
    with pytest.raises(UserError) as err:
        check_ray_address(token_head.address, 30)
    message = str(err.value)
    assert "\n" not in message and "refused the connection" in message and "RAY_AUTH_TOKEN" in message, message


@pytest.mark.parametrize("env, join", [("10.0.0.1:6379", ["--ray-address", "10.0.0.1:6379"]),
                                       ("http://127.0.0.1:8265", None)])  # a dashboard, for `ray job submit`
def test_a_cluster_named_only_by_ray_address_in_the_environment_is_refused_with_both_ways_out(
        ckpt, tmp_path, monkeypatch, env, join):
    from train_rl import prepare

    monkeypatch.setenv("RAY_ADDRESS", env)
    message = refused(args_for(ckpt, tmp_path), f"RAY_ADDRESS={env} is set, but a run joins a Ray cluster only with "
                      "--ray-address", "or unset RAY_ADDRESS to start a Ray of the run's own")
    if join:  # the advice, as written: the flag names the cluster (whether it answers is checked at ray.init)
        assert f"pass {' '.join(join)} to join that cluster" in message
        prepare(load_config(args_for(ckpt, tmp_path, *join))).release()
    else:
        assert "give --ray-address HEAD:6379 (the head's GCS address)" in message
    for unset in ("", "local"):  # unset (empty), or Ray's own word for a new instance
        monkeypatch.setenv("RAY_ADDRESS", unset)
        prepare(load_config(args_for(ckpt, tmp_path))).release()
