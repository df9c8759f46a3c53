"""The rules behind a run that heals, each on its own (the whole runs are tests/test_run_heals.py): the
restart bound and its window, metrics logged once per step across a restart, and --load defaulting to
--save for a requeued job."""
import json
import os
import time

import pytest

from orchestration.healing import RestartBudget, engines_lost
from rollout.health import EnginesLost
from vime.config import RunSection


class Clock:
    """Seconds that a test moves by hand (the budget's window is about time passing)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_restart_budget_allows_at_most_its_limit_within_any_window():
    clock = Clock()
    budget = RestartBudget(2, window_s=100, clock=clock)
    assert budget.take() and budget.take()
    assert not budget.take() and budget.used() == 2  # a refusal counts nothing
    clock.now = 100.5  # both fell out of the window
    assert budget.take() and budget.used() == 1
    clock.now = 150
    assert budget.take() and not budget.take()
    assert RestartBudget(0, window_s=100, clock=clock).take() is False  # 0: the first loss stops the run


def test_engines_lost_is_found_inside_the_error_ray_wraps_it_in():
    import ray.exceptions

    lost = EnginesLost(3, [(1, "ab", "died")])
    wrapped = ray.exceptions.RayTaskError("generate", "traceback", lost).as_instanceof_cause()  # as Ray raises it
    assert engines_lost(lost) is lost and engines_lost(wrapped).lost == [(1, "ab", "died")]
    assert engines_lost(RuntimeError("other")) is None
    assert str(lost) == "rollout worker 1 died at step 3"


def test_a_rewound_logger_logs_each_step_once(tmp_path):
    from vime.run_logger import RunLogger

    run_cfg = RunSection(output_dir=str(tmp_path), use_wandb=False)
    logger = RunLogger(run_cfg, {})
    for step in range(4):
        logger.log(step, {"x": step})
    logger.rewind(2)  # a trainer restart from the step-2 checkpoint
    for step in range(2, 5):
        logger.log(step, {"x": 10 * step})
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["rollout/step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["x"] for r in rows] == [0, 1, 20, 30, 40]  # the steps done again replace the lost ones
    assert [r["rollout/step"] for r in logger.history] == [0, 1, 2, 3, 4]
    # a resumed process that continues the same wandb run knows which steps that run already holds
    assert logger._keep_rows_before(3) == 4


def test_load_defaults_to_save_when_it_holds_a_checkpoint(tmp_path, capsys):
    from orchestration.run_setup import load_from_save_by_default

    save = tmp_path / "save"
    fresh = RunSection(save=str(save))
    assert not load_from_save_by_default(fresh) and fresh.load is None  # no directory yet
    os.makedirs(save / "iter_0000002")
    given = RunSection(save=str(save), load=str(tmp_path / "other"))
    assert not load_from_save_by_default(given) and given.load == str(tmp_path / "other")  # --load wins
    requeued = RunSection(save=str(save))
    assert load_from_save_by_default(requeued) and requeued.load == str(save)
    assert "--load defaults to --save" in capsys.readouterr().out


def wait_until_dead(actor, deadline_s=60):
    """Return once calls to `actor` fail as a dead actor's do: ray.kill is asynchronous, and a call made at once
    may still reach the actor before the kill does (and be answered, or fail as the call itself does)."""
    import ray
    import ray.exceptions

    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        try:
            ray.get(actor.heartbeat.remote(), timeout=deadline_s)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.RayTaskError:
            pass  # the call still reached the live actor
        time.sleep(0.1)
    raise AssertionError(f"the actor still answers {deadline_s} s after ray.kill")


def test_a_broken_push_finds_its_lost_engines_by_their_heartbeats():
    """After a weight push broke without any call saying why, `EngineWatch.probe` asks every engine: one whose
    engine process died says so (and is killed, its calls may never return), a dead worker is lost, a live one is
    not. Real Ray actors answering `heartbeat` as rollout workers do."""
    import ray

    from rollout.health import EngineDead, EngineWatch

    @ray.remote(num_cpus=0)
    class Peer:
        def __init__(self, engine_alive):
            self.engine_alive = engine_alive

        def heartbeat(self):
            if not self.engine_alive:
                raise EngineDead("its vllm engine process died")
            return 7

    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        live, no_engine, dead = Peer.remote(True), Peer.remote(False), Peer.remote(True)
        ray.get(dead.heartbeat.remote())
        ray.kill(dead, no_restart=True)
        wait_until_dead(dead)
        lost = EngineWatch(timeout_s=60).probe({0: live, 1: no_engine, 2: dead})
        assert set(lost) == {1, 2} and "engine process died" in lost[1] and lost[2].startswith("died")
        wait_until_dead(no_engine)  # raises if the worker whose engine died was not killed
    finally:
        ray.shutdown()


def test_a_worker_call_killed_by_rays_memory_monitor_is_a_lost_engine():
    """Ray's memory monitor ends the calls of a worker it kills with OutOfMemoryError, not RayActorError: the
    engine is lost all the same (replaced), while an error of the call itself is not a loss."""
    import ray.exceptions

    from rollout.health import lost_reason

    assert "memory monitor" in lost_reason(ray.exceptions.OutOfMemoryError("Task was killed due to the node running "
                                                                            "low on memory."))
    assert lost_reason(RuntimeError("a bug in the call")) is None


def test_a_worker_lost_while_the_engines_release_memory_is_a_lost_engine_for_the_run_to_heal():
    """The rollout manager's `release_memory` (every engine's, before the trainer's turn) with one worker dead: it
    raises EnginesLost naming that worker, which the driver heals (orchestration/rl_run.py), not another error.
    Real Ray actors answering `release_memory` as rollout workers do."""
    import ray

    from rollout.health import EngineWatch
    from rollout.ray_workers import RolloutManagerImpl

    @ray.remote(num_cpus=0)
    class Worker:
        def heartbeat(self):
            return 0

        def release_memory(self):
            return {}

    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        live, dead = Worker.remote(), Worker.remote()
        ray.get(dead.heartbeat.remote())
        ray.kill(dead, no_restart=True)
        wait_until_dead(dead)
        manager = object.__new__(RolloutManagerImpl)  # its workers and its watch: all release_memory reads
        manager.workers, manager.watch = [live, dead], EngineWatch(timeout_s=60)
        with pytest.raises(EnginesLost) as lost:
            manager.release_memory()
        assert [(i, why.split(" ")[0]) for i, _, why in lost.value.lost] == [(1, "died")]
    finally:
        ray.shutdown()


def test_an_engine_lost_while_a_checked_push_compares_every_tensor_is_a_lost_engine_for_the_run_to_heal():
    """--check-weight-update-equal asks every worker for its tensors' digests after a push: a worker dead by then
    ends it with EnginesLost naming that worker (which the driver heals, orchestration/rl_run.py), not with the
    bare actor error that would stop the run. Real Ray actors answering `digests` as workers and ranks do."""
    import ray

    from orchestration.driver import WeightSync
    from rollout.health import EngineWatch

    @ray.remote(num_cpus=0)
    class Holder:
        def heartbeat(self):
            return 0

        def digests(self):
            return {"w": "same"}

    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        rank, live, dead = Holder.remote(), Holder.remote(), Holder.remote()
        ray.get(dead.heartbeat.remote())
        ray.kill(dead, no_restart=True)
        wait_until_dead(dead)
        sync = object.__new__(WeightSync)  # its ranks, workers and watch: all the comparison reads
        sync.trainers = type("Trainers", (), {"actors": [rank]})()
        sync.workers, sync.watch = [live, dead], EngineWatch(timeout_s=60)
        with pytest.raises(EnginesLost) as lost:
            sync._compare_every_tensor(3)
        assert [(i, why.split(" ")[0]) for i, _, why in lost.value.lost] == [(1, "died")] and lost.value.step == 2
    finally:
        ray.shutdown()
