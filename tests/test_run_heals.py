"""A run that heals: real `python train_rl.py` runs on real Ray whose rollout engines or trainer ranks
are killed (kill -9) or stopped (SIGSTOP) mid-run, against an unfaulted run with the same seed.

- a rollout worker killed: replaced, the weights pushed and checked, the step's lost prompts issued
  again; every step logged once, with the prompts of the unfaulted run;
- a trainer rank killed: the run restarts from its checkpoint in-process and its steps reproduce the
  unfaulted run's metrics;
- a stopped engine: killed once the health timeout passed, replaced, the run finishes;
- past --max-engine-restarts: the run stops with one line.
Nothing of the run (its Ray processes, the shared memory they mapped) remains after any of them.
"""
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.test_train_rl import REPO, TIMING_KEYS, base_args, ckpt, metrics  # noqa: F401 (ckpt: fixture)

STEPS = 6
RESTART_LINE = re.compile(r"\[vime\] step (\d+): rollout worker (\d+)(?: on node \S+ \([^)]*\))? (.*); replacing it on its "
                          r"placement and pushing it the current weights, checked \(engine restart (\d+), ")


def fault_args(ckpt, out, *extra):  # noqa: F811
    """Six steps on two rollout engines, saved every 2 steps, every sync checked tensor by tensor, each
    step's samples kept (their prompts are compared)."""
    return base_args(ckpt, out, STEPS, "--rollout-num-workers", 2, "--save", os.path.join(out, "save"),
                     "--save-interval", 2, "--check-weight-update-equal", "--use-wandb", "false",
                     "--save-debug-rollout-data", os.path.join(out, "rollouts"), *extra)


class WatchedRun:
    """`python train_rl.py` in the background, its output read line by line (with the time each came) and
    its process tree recorded while it runs (what must be gone once it ends)."""

    def __init__(self, args, env_extra=None):
        env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline", WANDB_SILENT="true", **(env_extra or {}))
        env.pop("RAY_AUTH_MODE", None)
        self.proc = subprocess.Popen([sys.executable, "train_rl.py", *map(str, args)], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines, self.err, self.seen, self.shm = [], [], {}, set()
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True),
                        threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True)]
        for t in self.readers:
            t.start()

    @staticmethod
    def _read(stream, into):
        for line in stream:
            into.append((time.monotonic(), line.rstrip("\n")))

    def record_tree(self):
        """Add the run's processes (pid, start time) and the /dev/shm files they map to what was seen."""
        try:
            procs = [psutil.Process(self.proc.pid)] + psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return
        for p in procs:
            try:
                self.seen[p.pid] = p.create_time()
                self.shm |= {m.path for m in p.memory_maps(grouped=True) if m.path.startswith("/dev/shm/")}
            except psutil.Error:
                pass

    def process(self, needle):
        """A live process of the run whose command line (or name) holds `needle`, and whose parent does
        not (not a process it forked, such as a checkpoint writer)."""
        def matches(p):
            try:
                return needle in " ".join(p.cmdline()) or needle in p.name()
            except psutil.Error:
                return False

        found = [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                 if matches(p) and not matches(p.parent())]
        assert found, f"no process of the run matches {needle!r}"
        return found[0]

    def wait_for_rows(self, out, rows, timeout=900):
        log = os.path.join(out, "metrics.jsonl")
        deadline = time.time() + timeout
        while time.time() < deadline:
            if logged_rows(log) >= rows:
                return
            self.record_tree()
            assert self.proc.poll() is None, "\n".join(x for _, x in self.err)[-3000:]
            time.sleep(0.5)
        raise AssertionError(f"the run logged fewer than {rows} steps in {timeout} s")

    def fault_at_rows(self, out, rows, fault, timeout=900):
        """Stop the run's driver (SIGSTOP) as soon as it has logged `rows` steps, apply `fault()` (kill or stop
        a process of the run), and let the driver go on: the fault lands with at least two of the run's steps
        still to do however fast they are (a tiny model's take a tenth of a second, less than a poll of
        `wait_for_rows`, so a fault applied after it could land once the run no longer needs the process)."""
        log = os.path.join(out, "metrics.jsonl")
        deadline = time.time() + timeout
        while logged_rows(log) < rows:
            assert self.proc.poll() is None and time.time() < deadline, "\n".join(x for _, x in self.err)[-3000:]
            time.sleep(0.01)
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            self.record_tree()  # the processes the run has (polling recorded none: it would be slower than a step)
            logged = logged_rows(log)
            assert logged <= STEPS - 2, f"the driver was stopped only after {logged} of {STEPS} steps"
            fault()
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def finish(self, timeout=1500):
        deadline = time.time() + timeout
        while self.proc.poll() is None and time.time() < deadline:
            self.record_tree()
            time.sleep(0.5)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for t in self.readers:
            t.join(timeout=30)
        return self.proc.returncode

    def stdout(self):
        return "\n".join(x for _, x in self.lines)

    def stderr(self):
        return "\n".join(x for _, x in self.err)

    def left_behind(self, grace_s=30):
        """The run's processes still alive `grace_s` after it ended (those ending then are given the time,
        on a loaded machine) as 'pid command line', and the /dev/shm files its processes mapped that remain."""
        procs = []
        for pid, started in self.seen.items():
            try:
                proc = psutil.Process(pid)
                if abs(proc.create_time() - started) < 1e-3:
                    procs.append(proc)
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        left = []
        for proc in alive:
            try:
                left.append(f"{proc.pid} {' '.join(proc.cmdline())[:200]}")
            except psutil.Error:
                pass
        return left, sorted(p for p in self.shm if os.path.exists(p))


def logged_rows(log):
    """How many steps' rows the run's metrics.jsonl `log` holds (0 before it exists)."""
    if not os.path.exists(log):
        return 0
    with open(log) as f:
        return f.read().count("\n")


def step_prompts(out):
    """{step: sorted prompt token ids of its samples} from --save-debug-rollout-data."""
    found = {}
    folder = os.path.join(out, "rollouts")
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            found[int(name[5:12])] = sorted(tuple(s.prompt_ids) for s in pickle.load(f))
    return found


def without_timings(row):
    """A step's metrics but those of the machine (times, memory) and the fault counts."""
    return {k: v for k, v in row.items() if not k.startswith(TIMING_KEYS + ("memory/", "fault/"))}


@pytest.fixture(scope="module")
def unfaulted(ckpt, tmp_path_factory):  # noqa: F811
    out = str(tmp_path_factory.mktemp("unfaulted"))
    run = WatchedRun(fault_args(ckpt, out))
    assert run.finish() == 0, run.stderr()[-3000:]
    return out


def assert_nothing_left(run):
    alive, shm = run.left_behind()
    assert alive == [] and shm == [], (alive, shm)


@pytest.mark.e2e  # two whole runs (the unfaulted one shared), a few minutes on 2 cores
def test_a_killed_rollout_worker_is_replaced_and_the_run_goes_on_with_the_same_prompts(ckpt, unfaulted, tmp_path):  # noqa: F811
    out = str(tmp_path / "out")
    run = WatchedRun(fault_args(ckpt, out))
    run.fault_at_rows(out, 2, lambda: run.process("ray::RolloutWorker").kill())  # step 2 under way
    assert run.finish() == 0, run.stderr()[-3000:]
    rows = metrics(out)
    assert [r["rollout/step"] for r in rows] == list(range(STEPS))  # every step once
    restarts = [RESTART_LINE.search(x) for x in run.stdout().splitlines()]
    restarts = [m for m in restarts if m]
    assert len(restarts) == 1 and restarts[0].group(3).startswith("died"), run.stdout()[-3000:]
    assert sum(r["fault/engine_restarts"] for r in rows) == 1
    assert rows[int(restarts[0].group(1))]["fault/engine_restarts"] == 1
    # a loss found while the step generated issues the lost engine's groups again (two of the four, on two
    # engines); one found later (releasing memory, the push) has none to issue: both are the step's rule
    assert sum(r["fault/prompts_reissued"] for r in rows) in (0, 2)
    # the guard passed after the restart (the run stops otherwise) and at every step after it
    assert all(r["weight_sync/worker_draft_checksum"] == r["weight_sync/draft_checksum"] for r in rows)
    assert step_prompts(out) == step_prompts(unfaulted)
    assert "Traceback" not in run.stderr()
    assert_nothing_left(run)


@pytest.mark.slow  # two whole runs (the unfaulted one shared), a few minutes on 2 cores
def test_a_killed_trainer_rank_restarts_the_run_from_its_checkpoint_and_reproduces_the_unfaulted_steps(
        ckpt, unfaulted, tmp_path):  # noqa: F811
    out = str(tmp_path / "out")
    run = WatchedRun(fault_args(ckpt, out))
    # steps 0-2 logged, the step-2 checkpoint saved: step 3 is under way
    run.fault_at_rows(out, 3, lambda: run.process("ray::TrainerActor").kill())
    assert run.finish() == 0, run.stderr()[-3000:]
    lines = [x for x in run.stdout().splitlines() if "restarting the trainers and the rollout engines" in x]
    assert len(lines) == 1 and "from the step-2 checkpoint in --save" in lines[0], run.stdout()[-3000:]
    rows, reference = metrics(out), metrics(unfaulted)
    assert [r["rollout/step"] for r in rows] == list(range(STEPS))
    assert sum(r["fault/trainer_restarts"] for r in rows) == 1
    for got, want in zip(rows, reference):  # the lost steps were done again as the unfaulted run did them
        assert without_timings(got) == without_timings(want), got["rollout/step"]
    assert step_prompts(out) == step_prompts(unfaulted)
    assert "Traceback" not in run.stderr()
    assert_nothing_left(run)


@pytest.mark.slow  # a whole run, about a minute on 2 cores
def test_engine_restarts_past_the_bound_stop_the_run_with_one_line(ckpt, tmp_path):  # noqa: F811
    out = str(tmp_path / "out")
    run = WatchedRun(fault_args(ckpt, out, "--max-engine-restarts", 0))
    run.fault_at_rows(out, 2, lambda: run.process("ray::RolloutWorker").kill())
    assert run.finish() == 1, run.stderr()[-3000:]
    errors = [x for x in run.stderr().splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(
        r"error: the rollout worker \d( on node \S+ \([^)]*\))? died \(its process exited or was killed, e\.g\. out of memory\) at "
        r"step 2, and the run's engines were restarted 0 times already \(at most 0 within 3600 s: "
        r"--max-engine-restarts\); stopping; resume with --load .* \(last checkpoint: step 2\)", errors[0]), errors
    assert run.stderr().strip().splitlines()[-1] == errors[0]
    assert "Traceback" not in run.stderr()
    assert_nothing_left(run)


@pytest.mark.slow  # a whole run, one to two minutes on 2 cores
def test_a_stopped_engine_is_found_within_the_health_timeout_replaced_and_the_run_finishes(ckpt, tmp_path):  # noqa: F811
    timeout = 20
    out = str(tmp_path / "out")
    run = WatchedRun(fault_args(ckpt, out, "--rollout-health-timeout", timeout))
    run.fault_at_rows(out, 2, lambda: run.process("ray::RolloutWorker").suspend())  # SIGSTOP
    sent = time.monotonic()
    assert run.finish() == 0, run.stderr()[-3000:]
    found = [(t, RESTART_LINE.search(x)) for t, x in run.lines if RESTART_LINE.search(x)]
    assert len(found) == 1 and "made no progress" in found[0][1].group(3), run.stdout()[-3000:]
    # the watch polls every 2 s; the rest is Ray's kill and the machine's load
    assert found[0][0] - sent < timeout + 30
    assert [r["rollout/step"] for r in metrics(out)] == list(range(STEPS))
    assert_nothing_left(run)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_killed_vllm_engine_core_is_replaced_and_the_run_goes_on_with_the_same_prompts(tmp_path):
    pytest.importorskip("vllm")
    from tests import test_train_rl_vllm as v

    ckpt = str(tmp_path / "ckpt")  # noqa: F811
    v.make_tiny_mimo(ckpt, seed=5)
    v.write_jsonl(v.make_prompts(64, seed=1), os.path.join(ckpt, "train.jsonl"))

    def args(out):
        return v.base_args(ckpt, out, STEPS, "--save", os.path.join(out, "save"), "--save-interval", 2,
                           "--check-weight-update-equal", "--use-wandb", "false",
                           "--save-debug-rollout-data", os.path.join(out, "rollouts"))

    reference = str(tmp_path / "reference")
    run = WatchedRun(args(reference))
    assert run.finish() == 0, run.stderr()[-3000:]
    out = str(tmp_path / "out")
    run = WatchedRun(args(out))
    run.wait_for_rows(out, 2, timeout=1500)
    run.process("VLLM::EngineCore").kill()
    killed = time.monotonic()
    assert run.finish() == 0, run.stderr()[-3000:]
    rows = metrics(out)
    assert [r["rollout/step"] for r in rows] == list(range(STEPS))
    restarts = [(t, RESTART_LINE.search(x)) for t, x in run.lines if RESTART_LINE.search(x)]
    assert len(restarts) == 1 and "engine" in restarts[0][1].group(3), run.stdout()[-3000:]
    # found by its death, not by the health timeout (600 s by default) its waiting worker would reach
    assert restarts[0][0] - killed < 600
    assert sum(r["fault/engine_restarts"] for r in rows) == 1
    assert all(r["weight_sync/worker_draft_checksum"] == r["weight_sync/draft_checksum"] for r in rows)
    assert step_prompts(out) == step_prompts(reference)
    assert_nothing_left(run)


@pytest.mark.slow  # a rollout manager and its engines on a Ray of their own (about a minute on 2 cores)
def test_a_step_that_lost_an_engine_is_generated_again_with_its_prompts_and_only_the_lost_groups(ckpt, tmp_path):  # noqa: F811
    import ray

    from orchestration.run_setup import resolve_paths
    from rollout.data import PromptDataset, read_prompt_file
    from rollout.group_batching import groups_of, spread_groups
    from rollout.health import EnginesLost
    from rollout.ray_workers import RolloutManager
    from vime.cli_config import load_config

    cfg = load_config([str(a) for a in base_args(ckpt, tmp_path, 1, "--rollout-num-workers", 2)])
    resolve_paths(cfg)
    r = cfg.rollout
    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": REPO}})
    try:
        manager = RolloutManager.remote(r, ckpt, "grpo")
        assert ray.get(manager.started.remote()) == 2
        workers = ray.get(manager.get_workers.remote())
        lost_pid = ray.get(workers[1].__ray_call__.remote(lambda self: os.getpid()))
        psutil.Process(lost_pid).kill()
        with pytest.raises(EnginesLost, match="rollout worker 1 died"):
            ray.get(manager.generate.remote(0, 0))
        replaced = ray.get(manager.replace_workers.remote([1]))
        assert replaced[0] == workers[0] and replaced[1] != workers[1]
        samples, m = ray.get(manager.generate.remote(0, 0))
    finally:
        ray.shutdown()
    # the step's prompts: the first batch of the seeded order, as the data module draws it
    rows = read_prompt_file(r.prompt_data, r.input_key, r.label_key)
    want = PromptDataset(rows, r.rollout_batch_size, r.rollout_seed, r.rollout_shuffle).next_batch()
    assert [g[0].prompt for g in groups_of(samples)] == [p for p, _ in want]
    assert all(len(g) == r.n_samples_per_prompt for g in groups_of(samples))
    # only the lost engine's groups were generated again (the shard spread_groups gave worker 1)
    shards = spread_groups(groups_of(samples), 2, r.rollout_max_response_len)
    assert m["fault/prompts_reissued"] == len(groups_of(shards[1])) > 0
    assert {s.weight_version for s in samples} == {0}
