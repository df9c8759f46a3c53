"""What the driver does when a part of the run is lost mid-step, and how often it may.

- A rollout engine lost (its worker died, its engine process died, or it hung: rollout/health.py):
  the run replaces it and goes on (orchestration/rl_run.py `RLRun.heal`), at most
  --max-engine-restarts times within --engine-restart-window seconds (`RestartBudget`).
- A trainer rank lost: the run restarts the trainers and the engines from the newest valid
  checkpoint in --save (train_rl.py `run_loop`), at most --max-trainer-restarts times.
Past either bound, or where a restart cannot help, the run stops with one line as before.
"""
import time
from collections import deque

from rollout.health import EnginesLost


class RestartBudget:
    """At most `limit` restarts within any `window_s` seconds (None: over the whole run)."""

    def __init__(self, limit, window_s=None, clock=time.monotonic):
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self.times = deque()

    def take(self):
        """Count one restart if the budget allows it; False (nothing counted) when it is spent."""
        now = self.clock()
        while self.window_s is not None and self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True

    def used(self):
        return len(self.times)

    def describe(self):
        within = f" within {self.window_s:g} s" if self.window_s is not None else ""
        return f"at most {self.limit}{within}"


def engines_lost(error):
    """The EnginesLost `error` carries (Ray wraps the rollout manager's: its cause; the wrapper is an
    EnginesLost too, without the fields) or is, else None."""
    for candidate in (getattr(error, "cause", None), error):
        if isinstance(candidate, EnginesLost):
            return candidate
    return None


def engine_restart_line(name, why, step, budget):
    """The one line a replaced engine logs."""
    return (f"[vime] step {step}: {name} {why}; replacing it on its placement and pushing it the current "
            f"weights, checked (engine restart {budget.used()}, {budget.describe()}: --max-engine-restarts)")


def engine_budget_spent_line(name, why, step, budget, resume):
    """The one line of a run stopped because its engines were lost more often than allowed."""
    return (f"the {name} {why} at step {step}, and the run's engines were restarted {budget.used()} times already "
            f"({budget.describe()}: --max-engine-restarts); stopping; {resume}")


def trainer_restart_line(names, step, resumed_step, restart, limit):
    """The one line a trainer restart logs."""
    origin = f"the step-{resumed_step} checkpoint in --save" if resumed_step else "the start (no checkpoint yet)"
    return (f"[vime] step {step}: {' and '.join(names)} died; restarting the trainers and the rollout engines from "
            f"{origin} (trainer restart {restart} of at most {limit}: --max-trainer-restarts)")
