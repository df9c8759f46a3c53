"""Stop requests as a cluster sends them: SIGTERM (Slurm's preemption and time limit, Kubernetes'
pod stop) and SIGUSR1 (Slurm's `--signal`, ahead of the limit) stop the run at the next safe
point (the end of a step), where it saves when --save is set and exits with code 75 and a line saying
that the same command, requeued, resumes there (--load defaults to --save).
The scheduler's SIGKILL follows after a grace period, so the handler only notes the request: the
step in flight finishes, and nothing is interrupted half-written."""
import contextlib
import os
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Notes the first stop signal received; `name` is its name (e.g. "SIGTERM") or None."""

    def __init__(self):
        self.name = None
        self.signum = None
        self.previous = {}

    def install(self):
        """(Re-)install the handlers: Ray's ray.init installs its own SIGTERM handler (and its C++ one
        prints stack lines), so call this again once Ray is up."""
        for signum in STOP_SIGNALS:
            old = signal.signal(signum, self._note)
            self.previous.setdefault(signum, old)

    def restore(self):
        """The handlers from before the first `install` (main() may run inside another program)."""
        for signum, old in self.previous.items():
            signal.signal(signum, old if old is not None else signal.SIG_DFL)

    def _note(self, signum, frame):
        if self.name is None:
            self.name, self.signum = signal.Signals(signum).name, signum


@contextlib.contextmanager
def stop_signals_blocked_in_children():
    """Processes started inside this block (Ray's GCS and raylet, and through them every actor and
    the vLLM engine processes those start) inherit STOP_SIGNALS blocked; the caller's own mask is
    restored on exit, and so are its handlers (Ray installs its own at start; a signal that came
    during the block is delivered to the caller's handler when the mask lifts). Why: Slurm signals every process of a job step and `kill -TERM -PGID` a whole
    process group; Ray's processes would die of it (SIGUSR1's default action is to terminate too)
    before the driver could finish its step and save. Blocked there, only the driver acts on the
    signal; Ray's shutdown still stops them (SIGKILL after its one-second grace)."""
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# sysexits.h EX_TEMPFAIL, "a temporary failure; the user is invited to retry": the run saved where it
# stopped and the same command resumes there (a batch script requeues the job on this code)
EXIT_REQUEUE = 75


class StoppedBySignal(Exception):
    """The run stopped at a safe point on a stop signal; the message says where and how to resume.
    Exit code 75 (`EXIT_REQUEUE`) when it saved, so that the job can be requeued; else 128 + the signal."""

    def __init__(self, message, signum, requeue=False):
        super().__init__(message)
        self.exit_code = EXIT_REQUEUE if requeue else 128 + signum  # the shell's convention for "ended by it"


def stop_message(how, next_step, save_dir, saved_step=None):
    """One line: what stopped the run (e.g. "stopped by SIGTERM", "interrupted (Ctrl-C)"), at which
    step, and the --load that resumes it (or that no checkpoint exists to resume from)."""
    from vime.checkpointing import latest

    if saved_step is not None:
        return (f"{how} at step {next_step}: saved the step-{saved_step} checkpoint; the run can be requeued: the same "
                f"command resumes from it (--load defaults to --save {save_dir})")
    found = latest(save_dir) if save_dir and os.path.isdir(save_dir) else None
    if found:
        return f"{how} at step {next_step}; resume with --load {save_dir} (last checkpoint: step {found[0]})"
    return (f"{how} at step {next_step}; no checkpoint was saved: rerun with --save DIR to be able to resume "
            "(a stop signal saves before stopping)")


class Interrupted(Exception):
    """Ctrl-C mid-run; the message says at which step and which checkpoint to --load."""
