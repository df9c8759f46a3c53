"""A real `python train_rl.py` run as a cluster treats it: its local Ray refuses a client without
the token on the machine's network address, and SIGTERM / SIGUSR1 stop it at a step's end with a
checkpoint and one line naming the --load that resumes it bit for bit."""
import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from orchestration.stop_signals import EXIT_REQUEUE
from tests.test_train_rl import ckpt  # noqa: F401 (fixture)
from tests.test_train_rl import REPO, TIMING_KEYS, base_args, initial_draft_checksum, metrics, run_train

RAY_CRASH_LINES = ("*** SIGTERM", "PC: @", "Traceback", "*** SIGUSR1")
KEPT_BY_DESIGN = {f"torchinductor_{getpass.getuser()}"}  # torch names its compile cache so


def start_run(ckpt, out, steps, *extra, own_group=False, **env_vars):
    """`python train_rl.py` started in the background; own_group: in a process group of its own, as a
    batch job's step is (a signal to the group reaches the driver and every process it started)."""
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline", WANDB_SILENT="true", **env_vars)
    env.pop("RAY_AUTH_MODE", None)  # Ray's default: token authentication on
    return subprocess.Popen([sys.executable, "train_rl.py", *map(str, base_args(ckpt, out, steps, *extra))],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=own_group)


def wait_for_steps(proc, out, timeout=300, steps=1):
    """Until the run logged `steps` steps (or `timeout` seconds passed)."""
    log = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + timeout
    while time.time() < deadline and not (os.path.exists(log) and len(open(log).read().split()) >= steps):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.3)


def network_address():
    """This machine's own non-loopback IPv4 address (the one its default route leaves from)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # UDP connect sends nothing: it only picks the outgoing interface
        return s.getsockname()[0]
    finally:
        s.close()


def gcs_port(driver_pid):
    """The TCP port the run's own GCS server (a child of its driver) listens on."""
    for child in psutil.Process(driver_pid).children(recursive=True):
        if "gcs_server" in " ".join(child.cmdline()):
            ports = sorted({c.laddr.port for c in child.net_connections(kind="tcp") if c.status == "LISTEN"})
            assert len(ports) == 1, ports
            return ports[0]
    raise AssertionError("the run started no GCS server of its own")


def connect_as_client(address, home, extra_env):
    """A separate Ray client joining `address`; rc 0 and JOINED when it got in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), **extra_env)
    code = f"import ray; ray.init(address={address!r}); print('JOINED', len(ray.nodes()))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)


def stop_line(proc_stderr):
    lines = [x for x in proc_stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, proc_stderr[-3000:]
    return lines[0]


def sigterm_the_group(proc, out, save, first_step_s, end_s, before=None):
    """After the run's first step (and `before()`), SIGTERM to its whole process group, as a batch
    system sends it (the driver, Ray's processes, vLLM's engine processes); waits for the end and
    checks the exit code. Returns stdout, stderr and the match of the one line naming the saved step."""
    try:
        wait_for_steps(proc, out, timeout=first_step_s)
        if before is not None:
            before()
        os.killpg(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=end_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_REQUEUE, stderr[-3000:]
    m = re.fullmatch(rf"error: stopped by SIGTERM at step (\d+): saved the step-\1 checkpoint; the run can be "
                     rf"requeued: the same command resumes from it \(--load defaults to --save "
                     rf"{re.escape(str(save))}\)", stop_line(stderr))
    return stdout, stderr, m


@pytest.mark.e2e  # a whole run (1-2 min on 2 cores): CI's end-to-end command runs it
def test_a_default_run_refuses_a_client_without_the_token_and_sigusr1_saves_and_says_where(ckpt, tmp_path):
    """Also: the run starts its own Ray although Ray's temp dir names another cluster (what a `ray start`
    leaves there, and keeps after it has ended), and holds its --output-dir and --save against others; and
    its draft, not trained (no --enable-mtp-training), stays bitwise the checkpoint's in the rollout while
    the trunk trains (the weight guard compares the rollout's with the trainer's after every sync)."""
    from vime.errors import UserError
    from vime.run_lock import DirLock

    if network_address().startswith("127."):
        pytest.skip("this machine has no network address besides loopback")
    out, save = tmp_path / "out", tmp_path / "save"
    system_tmp = tempfile.mkdtemp(prefix="vt", dir="/tmp")  # short: Ray's socket paths live under it
    os.makedirs(os.path.join(system_tmp, "ray"))
    with open(os.path.join(system_tmp, "ray", "ray_current_cluster"), "w") as f:
        f.write("127.0.0.1:1")  # no Ray there: joining it would fail the run
    proc = start_run(ckpt, out, 100000, "--save", save, "--check-weight-update-equal", TMPDIR=system_tmp)
    try:
        wait_for_steps(proc, out, steps=2)  # two syncs: the trunk moved between them
        for flag, directory in (("--output-dir", out), ("--save", save)):  # what a second run on them meets
            with pytest.raises(UserError, match=rf"is in use by another run \(pid {proc.pid} on host "):
                DirLock(str(directory), flag)
        address = f"{network_address()}:{gcs_port(proc.pid)}"
        # control: the same client with this user's token (its real HOME holds Ray's ~/.ray/auth_token) gets in
        holder = connect_as_client(address, os.path.expanduser("~"), {"RAY_AUTH_MODE": "token"})
        assert holder.returncode == 0 and "JOINED" in holder.stdout, holder.stderr[-3000:]
        # a stranger: no token (another HOME), sending none
        stranger = connect_as_client(address, tmp_path / "stranger_home", {"RAY_AUTH_MODE": "disabled"})
        assert stranger.returncode != 0 and "JOINED" not in stranger.stdout
        assert "InvalidAuthToken" in stranger.stderr or "AuthenticationError" in stranger.stderr, stranger.stderr[-3000:]
        proc.send_signal(signal.SIGUSR1)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_REQUEUE, stderr[-3000:]
    line = stop_line(stderr)
    m = re.fullmatch(rf"error: stopped by SIGUSR1 at step (\d+): saved the step-(\d+) checkpoint; the run can be "
                     rf"requeued: the same command resumes from it \(--load defaults to --save "
                     rf"{re.escape(str(save))}\)", line)
    assert m and m.group(1) == m.group(2), line
    assert not any(x in stdout + stderr for x in RAY_CRASH_LINES), stderr[-3000:]
    steps_done = int(m.group(1))
    rows = metrics(out)
    assert len(rows) == steps_done >= 2  # --save-interval 0: saved anyway, at the signal's step
    assert {r["weight_sync/worker_draft_checksum"] for r in rows} == {initial_draft_checksum(ckpt)}
    assert len({r["weight_sync/target_checksum"] for r in rows}) == steps_done  # the trunk trained every step
    assert all("train/mtp_loss" not in r for r in rows)
    assert json.load(open(save / "latest_checkpointed_iteration.txt")) == {"step": steps_done}
    # nothing left in the system temp dir but Ray's own session directory and torch's per-user compile
    # cache (both kept by design for the next run); wandb's and the actors' temp files are removed
    assert set(os.listdir(system_tmp)) - KEPT_BY_DESIGN == {"ray"}, os.listdir(system_tmp)
    shutil.rmtree(system_tmp, ignore_errors=True)


@pytest.mark.slow  # a whole run of its own (1-2 min on 2 cores)
def test_sigterm_to_the_whole_process_group_saves_the_step_and_the_resume_reproduces_an_uninterrupted_run(
        ckpt, tmp_path):
    # as Slurm signals every process of a job step: the driver, Ray's GCS and raylet, every actor
    out, save = tmp_path / "out", tmp_path / "save"
    proc = start_run(ckpt, out, 100000, "--use-wandb", "false", "--save", save, "--save-interval", 1000,
                     own_group=True)
    stdout, stderr, m = sigterm_the_group(proc, out, save, first_step_s=300, end_s=180)
    assert m, stderr[-3000:]
    assert not any(x in stdout + stderr for x in RAY_CRASH_LINES), stderr[-3000:]
    k = int(m.group(1))
    assert k < 50  # stopped at the next safe point, not at the end

    # requeued: the same command (only --num-rollout raised, to end soon) resumes from --save by itself
    proc = run_train(*base_args(ckpt, out, k + 2, "--use-wandb", "false", "--save", save, "--save-interval", 1000))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference_out, reference_save = tmp_path / "ref", tmp_path / "ref_save"
    proc = run_train(*base_args(ckpt, reference_out, k + 2, "--use-wandb", "false", "--save", reference_save,
                                "--save-interval", 1, "--save-keep", 2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, reference = metrics(out), metrics(reference_out)
    assert [r["rollout/step"] for r in resumed] == list(range(k + 2))
    for got, want in zip(resumed, reference):  # the stopped run's steps, then the resumed ones
        assert {key: v for key, v in got.items() if not key.startswith(TIMING_KEYS)} == \
               {key: v for key, v in want.items() if not key.startswith(TIMING_KEYS)}
    # --save-keep 2 with a save every step: the two newest remain, the latest names the last step
    assert sorted(x for x in os.listdir(reference_save) if x.startswith("iter_")) == \
           [f"iter_{k + 1:07d}", f"iter_{k + 2:07d}"]


def shared_memory_of(pid):
    """The /dev/shm files the process tree of `pid` has mapped or open (vLLM's rings, Ray's plasma store)."""
    found = set()
    procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    for p in procs:
        try:
            found |= {m.path for m in p.memory_maps(grouped=True) if m.path.startswith("/dev/shm/")}
            found |= {f.path for f in p.open_files() if f.path.startswith("/dev/shm/")}
        except psutil.Error:  # a process that ended meanwhile
            pass
    return found


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigterm_on_the_vllm_backend_saves_releases_shared_memory_and_resumes(tmp_path):
    pytest.importorskip("vllm")
    from tests import test_train_rl_vllm as v

    ckpt = str(tmp_path / "ckpt")
    v.make_tiny_mimo(ckpt, seed=5)
    v.write_jsonl(v.make_prompts(64, seed=1), os.path.join(ckpt, "train.jsonl"))
    out, save = tmp_path / "out", tmp_path / "save"
    system_tmp = tempfile.mkdtemp(prefix="vt", dir="/tmp")
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline", WANDB_SILENT="true", TMPDIR=system_tmp)
    env.pop("RAY_AUTH_MODE", None)
    proc = subprocess.Popen([sys.executable, "train_rl.py", *map(str, v.base_args(ckpt, out, 100000, "--save", save))],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    seen = {}
    stdout, stderr, m = sigterm_the_group(proc, out, save, first_step_s=900, end_s=300,
                                          before=lambda: seen.update(shm=shared_memory_of(proc.pid)))
    shm = seen["shm"]
    # only tracebacks outside vLLM's WARNING lines count (vLLM's console is filtered, not silenced)
    crash = [x for x in (stdout + stderr).splitlines() if any(c in x for c in RAY_CRASH_LINES) and "WARNING" not in x]
    assert m and not crash, crash
    assert any("psm_" in p for p in shm), shm  # vLLM's shared-memory rings were in use ...
    time.sleep(2)
    assert [p for p in shm if os.path.exists(p)] == []  # ... and are released
    assert set(os.listdir(system_tmp)) - KEPT_BY_DESIGN == {"ray"}, os.listdir(system_tmp)  # vLLM's sockets went too
    shutil.rmtree(system_tmp, ignore_errors=True)
    k = int(m.group(1))

    # the resume reproduces an uninterrupted run bit for bit: every metric but the timings (vLLM's
    # seeded sampling, speculation included, does not depend on which instance runs it)
    proc = v.run_train(*v.base_args(ckpt, out, k + 2, "--load", save))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference_out = tmp_path / "ref"
    proc = v.run_train(*v.base_args(ckpt, reference_out, k + 2, "--save", tmp_path / "ref_save"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, reference = metrics(out), metrics(reference_out)
    assert [r["rollout/step"] for r in resumed] == list(range(k + 2))
    assert resumed[k]["rollout/weight_version"] == k  # generated with the checkpoint's weights
    for got, want in zip(resumed, reference):
        assert {key: x for key, x in got.items() if not key.startswith(TIMING_KEYS)} == \
               {key: x for key, x in want.items() if not key.startswith(TIMING_KEYS)}
