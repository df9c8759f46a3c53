"""Whether the rollout engines are alive and making progress, and what a lost one leaves behind.

- `EngineWatch.wait(calls)` waits on calls to rollout workers the way `ray.get` would, and meanwhile
  asks each busy worker for a heartbeat (answered on its own thread, beside the call). A worker is
  *lost* when its process died (Ray says so), when its engine died under it (vLLM's EngineCore
  process: the worker's call or its heartbeat says so, `EngineDead`, and a worker whose heartbeat
  said so is killed, its call waiting on the dead engine), or when it made no progress for the health timeout
  (its progress count, engine steps taken and weight buckets received, did not move, or it did not
  answer at all: a stopped or hung process, its own or its engine's); a hung worker is killed. The caller decides what a
  loss means (the rollout manager re-issues the step's unfinished groups, the driver replaces it).
- `EnginesLost`: what the rollout manager raises when a step lost engines, kept for a retry.
- `engine_leftovers()` / `reap(leftovers)`: the processes and shared-memory rings an engine started
  (vLLM's EngineCore and its worker, their /dev/shm message rings), recorded when it starts and
  removed once its worker is gone: a SIGKILL gives the engine no chance to remove them itself.
"""
import os
import time

import ray


class EngineDead(RuntimeError):
    """A rollout worker's engine died under the live worker (vLLM's EngineCore process); the worker
    closed what was left of it and must be replaced."""


class EngineHung(RuntimeError):
    """A rollout worker made no progress for the health timeout and was killed."""


class EnginesLost(RuntimeError):
    """The rollout manager lost engines during a step: `lost` is [(worker index, actor id hex, why)]."""

    def __init__(self, step, lost):
        super().__init__(step, lost)

    @property
    def step(self):
        return self.args[0]

    @property
    def lost(self):
        return self.args[1]

    def __str__(self):
        return "; ".join(f"rollout worker {i} {why}" for i, _, why in self.lost) + f" at step {self.step}"


def lost_reason(error):
    """Why `error` (an outcome of a call to a rollout worker) means the worker is lost, or None when
    it does not (any other error is a bug of the call, not a loss)."""
    from ray.exceptions import OutOfMemoryError, RayActorError

    if isinstance(error, EngineHung):
        return str(error)
    if isinstance(error, RayActorError):
        return "died (its process exited or was killed, e.g. out of memory)"
    if isinstance(error, OutOfMemoryError):  # the call of a worker Ray's memory monitor killed
        return "was killed by Ray's memory monitor (out of memory)"
    cause = getattr(error, "cause", None)
    if isinstance(cause, EngineDead):
        return f"lost its engine ({cause})"
    return None


class EngineWatch:
    """Waits on calls to rollout workers and kills a worker that stops making progress (module docstring)."""

    def __init__(self, timeout_s, poll_s=None):
        self.timeout_s = timeout_s
        self.poll_s = poll_s if poll_s is not None else min(2.0, timeout_s / 4)

    def wait(self, calls, on_failure=None):
        """{key: outcome} of `calls`, {key: (worker or None, ObjectRef)}: the call's value, or the exception
        it ended with (an `EngineHung` for a worker killed for making no progress). Calls without a worker
        are waited on only. `on_failure(key, error)` is called at the first failure, as it happens (the
        weight push aborts the others' broadcast then, rather than at gloo's timeout)."""
        pending = {key: ref for key, (_, ref) in calls.items()}
        workers = {key: worker for key, (worker, _) in calls.items() if worker is not None}
        outcomes, failed = {}, False
        seen = {key: (None, time.monotonic()) for key in workers}  # last progress count and when it moved
        beats = {}
        while pending:
            done, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=self.poll_s)
            for key in [k for k, ref in pending.items() if ref in done]:
                outcomes[key] = _outcome(pending.pop(key))
            for key in [k for k in pending if k in workers]:
                hung = self._check(key, workers[key], seen, beats)
                if hung is not None:
                    outcomes[key] = hung
                    pending.pop(key)
            first = next((e for e in outcomes.values() if isinstance(e, BaseException)), None)
            if first is not None and not failed:
                failed = True
                if on_failure is not None:
                    on_failure(next(k for k, e in outcomes.items() if e is first), first)
        return outcomes

    def probe(self, workers):
        """{key: why lost} of `workers` ({key: worker}) found lost when asked now: dead, or saying that their
        engine died (those are killed). For a push that broke without a call saying why: the peer whose
        process died mid-broadcast (an engine's own process, or the worker's) is found by its heartbeat."""
        beats = {key: worker.heartbeat.remote() for key, worker in workers.items()}
        ready, _ = ray.wait(list(beats.values()), num_returns=len(beats), timeout=self.timeout_s)
        lost = {}
        for key, beat in beats.items():
            answer = _outcome(beat) if beat in ready else EngineHung(
                f"did not answer its heartbeat within {self.timeout_s:g} s (--rollout-health-timeout); killed it")
            if isinstance(getattr(answer, "cause", None), EngineDead) or isinstance(answer, EngineHung):
                ray.kill(workers[key], no_restart=True)
            why = lost_reason(answer) if isinstance(answer, BaseException) else None
            if why:
                lost[key] = why
        return lost

    def wait_started(self, refs):
        """{key: value or exception} of the first calls to workers just created, {key: ObjectRef}: their
        engines must start within the health timeout (an EngineHung otherwise; the caller kills them)."""
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout_s)
        return {key: _outcome(ref) if ref in ready else
                EngineHung(f"did not start within {self.timeout_s:g} s (--rollout-health-timeout)")
                for key, ref in refs.items()}

    def _check(self, key, worker, seen, beats):
        """Read `worker`'s heartbeat if it answered (and ask again); an EngineHung once it was killed for
        making no progress, the heartbeat's error once it said its engine died (the worker killed too)."""
        beat = beats.get(key)
        if beat is not None:
            ready, _ = ray.wait([beat], timeout=0)
            if ready:
                del beats[key]
                answer = _outcome(beat)
                if isinstance(getattr(answer, "cause", None), EngineDead):  # its call may never return
                    ray.kill(worker, no_restart=True)
                    return answer
                if isinstance(answer, BaseException):  # dead: its call's own error says so
                    return None
                if answer != seen[key][0]:
                    seen[key] = (answer, time.monotonic())
        if key not in beats:
            beats[key] = worker.heartbeat.remote()
        idle = time.monotonic() - seen[key][1]
        if idle <= self.timeout_s:
            return None
        ray.kill(worker, no_restart=True)  # SIGKILL: it ends a stopped process too
        return EngineHung(f"made no progress for {idle:.0f} s (--rollout-health-timeout {self.timeout_s:g}); "
                          "killed it")


def first_line(error):
    """The first line of an error's text (its type's name when it has none)."""
    text = str(getattr(error, "cause", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _outcome(ref):
    try:
        return ray.get(ref)
    except Exception as e:  # noqa: BLE001 (the caller classifies every outcome)
        return e


def engine_leftovers():
    """What this process's engine started that outlives a SIGKILL of this process: its child processes
    ([pid, start time], so a pid reused later is never touched) and the vLLM message rings
    (/dev/shm/psm_*) they map. {} of each for an engine inside this process."""
    import psutil

    procs, rings = [], set()
    for child in psutil.Process().children(recursive=True):
        try:
            procs.append((child.pid, child.create_time()))
            rings |= {m.path for m in child.memory_maps(grouped=True) if m.path.startswith("/dev/shm/psm_")}
        except psutil.Error:  # a child that ended meanwhile
            pass
    return {"node_id": ray.get_runtime_context().get_node_id(), "processes": procs, "shm": sorted(rings)}


def reap(leftovers):
    """Kill the recorded processes that still run (same pid and start time) and remove the recorded
    rings: the engine they served is gone. Must run on the node they were recorded on."""
    import psutil

    victims = []
    for pid, started in (leftovers or {}).get("processes", []):
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - started) < 1e-3:
                proc.kill()
                victims.append(proc)
        except psutil.Error:
            pass
    psutil.wait_procs(victims, timeout=30)
    for path in (leftovers or {}).get("shm", []):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
