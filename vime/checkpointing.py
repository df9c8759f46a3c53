"""Atomic, verified RL checkpoints: torch_dist model + optimizer (written by the trainers), the loop
state, and a manifest of every file's size and checksum (vime/manifest.py).

A checkpoint is written into `iter_XXXXXXX.tmp/`, its manifest last, renamed to `iter_XXXXXXX/` when
complete, and only then recorded in `latest_checkpointed_iteration.txt` (written to a temp file and
`os.replace`d). A crash mid-save leaves a `.tmp` directory and the previous checkpoint loadable.

`resolve_load` decides what `--load` resumes from, checking every file against the manifest before
any of it is read: `--load ROOT` takes the checkpoint `latest_checkpointed_iteration.txt` names, or
the newest valid one below it when that one is damaged (saying which it skipped and why);
`--load ROOT/iter_NNNNNNN`, or `--load ROOT --ckpt-step N` (Megatron's flag), takes that one or none.
The loop state is JSON (`loop_state.json`): loading it runs no code. The torch_dist model
directory's `.metadata` is a pickle by torch's design, so a checkpoint is trusted input.
"""
import errno
import json
import os
import re
import shutil

from vime.errors import UserError, require
from vime.manifest import manifest_problem, write_manifest
from vime.paths import require_dir, require_given

LATEST = "latest_checkpointed_iteration.txt"
LOOP_STATE = "loop_state.json"
ITERATION = re.compile(r"iter_(\d{7})$")


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, read-only, a writer that died, ...); the partial .tmp was
    removed. `original`: the error the writing raised (the driver tells a dead trainer rank from a disk)."""

    def __init__(self, message, original=None):
        super().__init__(message)
        self.original = original


def iteration_dir(root, step):
    return os.path.join(root, f"iter_{step:07d}")


def save(root, step, write_model, loop_state, keep=None):
    """write_model(path) writes the trainer checkpoint; loop_state (a JSON dict) is written beside it,
    then the manifest of every file. keep: after the new checkpoint is the latest, remove all but the
    `keep` newest (None: keep all).

    A failure removes the partial `.tmp` (it would otherwise fill the disk) and raises
    CheckpointSaveError saying what happened and what is on disk to resume from."""
    final = iteration_dir(root, step)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        write_model(os.path.join(tmp, "model"))
        with open(os.path.join(tmp, LOOP_STATE), "w") as f:
            json.dump(loop_state, f)
        write_manifest(tmp)  # last: a checkpoint without one was never finished
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(_save_failure(root, step, e), original=e) from None
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    _write_latest(root, step)
    if keep:
        prune(root, keep)
    return final


def checkpoint_steps(root):
    """Steps of the complete checkpoints under root (iter_XXXXXXX directories, not .tmp), ascending."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(m.group(1)) for m in map(ITERATION.match, names) if m)


def prune(root, keep):
    """Remove all but the `keep` newest complete checkpoints; never the one `latest` names (nor a .tmp
    being written: those are not complete checkpoints)."""
    found = latest(root)
    protected = {found[0]} if found else set()
    for step in checkpoint_steps(root)[:-keep]:
        if step not in protected:
            shutil.rmtree(iteration_dir(root, step), ignore_errors=True)


def _write_latest(root, step):
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({"step": step}))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))


def _root_cause(e):
    """The innermost exception (Ray wraps an actor's error as `.cause`, Python as __cause__)."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = getattr(e, "cause", None) or e.__cause__ or e.__context__
        if not isinstance(inner, BaseException):
            break
        e = inner
    return e


def _save_failure(root, step, e):
    """One line: why the save failed, and what --save holds now (checked, not assumed) to resume from."""
    cause = _root_cause(e)
    code = getattr(cause, "errno", None)
    free = shutil.disk_usage(root).free if os.path.isdir(root) else None
    if code == errno.ENOSPC or (free is not None and free < 64 * 1024 * 1024):
        what = f"the disk is full ({free or 0} bytes free)"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        what = "it is not writable"
    else:
        what = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
    try:
        have, _, _ = resolve_load(root, flag="--save")
        there = (f"the newest valid checkpoint there is step {have}: free space (or choose another --save), then "
                 f"resume with --load {root}")
    except UserError:
        there = ("it holds no valid checkpoint to resume from: free space (or choose another --save) and run "
                 "again from the start")
    return (f"--save {root}: writing the step-{step} checkpoint failed ({what}); removed the partial "
            f"{os.path.basename(iteration_dir(root, step))}.tmp; {there}")


def _latest_step(root):
    """(step latest_checkpointed_iteration.txt names or None, what is wrong with the file or None)."""
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None, f"{LATEST} is missing"
    try:
        with open(path) as f:
            step = json.load(f)["step"]
        require(isinstance(step, int) and not isinstance(step, bool) and step >= 0, "bad step")
    except (ValueError, KeyError, TypeError, UserError):
        return None, f"{LATEST} is damaged"
    return step, None


def latest(root):
    """(step, iteration dir) that latest_checkpointed_iteration.txt names under root, or None (no such
    file, or a damaged one). Unverified: what a run's last message points to; --load verifies."""
    step, _ = _latest_step(root)
    return None if step is None else (step, iteration_dir(root, step))


def iteration_problem(iteration):
    """None when `iteration` is a complete checkpoint whose every file matches its manifest and whose loop
    state reads; else what is wrong, in a few words."""
    if not os.path.isdir(iteration):
        return "its directory is missing"
    problem = manifest_problem(iteration)
    if problem is not None:
        return problem
    try:
        state = load_loop_state(iteration)
    except (OSError, ValueError):  # written so by hand, or by another tool: the manifest only vouches for the bytes
        return f"{LOOP_STATE} is not JSON"
    return loop_state_problem(state)


# the loop state's keys and their JSON types ("step" required; a checkpoint of an older vime lacks the others)
LOOP_STATE_TYPES = {"step": (int, "an integer"), "data_cursor": (int, "an integer"),
                    "wandb_run_id": (str, "a string")}


def loop_state_problem(state):
    """What in a parsed loop_state.json is not of its type (`LOOP_STATE_TYPES`), or None."""
    if not isinstance(state, dict) or "step" not in state:
        return f"{LOOP_STATE} does not hold a JSON object with an integer \"step\""
    for key, (kind, name) in LOOP_STATE_TYPES.items():
        value = state.get(key)
        if key in state and (not isinstance(value, kind) or isinstance(value, bool) or
                             (kind is int and value < 0)):
            return f"{LOOP_STATE}'s \"{key}\" is {json.dumps(value)[:40]}, not {name}{' >= 0' if kind is int else ''}"
    return None


def resolve_load(path, ckpt_step=None, flag="--load", otherwise=None):
    """(step, iteration dir, [skipped: "iter_N (why)"]) of what `flag path` (and --ckpt-step) resumes
    from, every file verified against its manifest (module docstring); one UserError line otherwise,
    ending, when no checkpoint there is valid, with `otherwise` (what the caller's user can do instead)."""
    require_given(path, flag)
    path = os.path.normpath(path)
    if ITERATION.match(os.path.basename(path)):
        require(ckpt_step is None, f"--ckpt-step {ckpt_step} picks an iteration under {flag} ROOT, and {flag} {path} "
                "names one already: drop one of them")
        return _one_iteration(path, f"{flag} {path}", f"{flag} {os.path.dirname(path)}")
    require_dir(path, flag)
    if ckpt_step is not None:
        steps = checkpoint_steps(path)
        require(ckpt_step in steps, f"--ckpt-step {ckpt_step}: {flag} {path} holds no iter_{ckpt_step:07d} "
                f"(its checkpoints: steps {', '.join(map(str, steps)) or 'none'})")
        return _one_iteration(iteration_dir(path, ckpt_step), f"{flag} {path} --ckpt-step {ckpt_step}",
                              f"{flag} {path} without --ckpt-step")
    return _newest_valid(path, flag, otherwise)


def _one_iteration(iteration, given, instead):
    problem = iteration_problem(iteration)
    require(problem is None, f"{given}: {problem}; {instead} resumes from the newest valid checkpoint there")
    return load_loop_state(iteration)["step"], iteration, []


def _newest_valid(root, flag, otherwise):
    """The checkpoint latest_checkpointed_iteration.txt names, else the newest valid one below it (or, with
    no readable file, the newest valid one there); the ones passed over, each with why."""
    named, note = _latest_step(root)
    steps = checkpoint_steps(root)
    if named is None:
        require(steps, f"{flag} {root}: no checkpoint there ({note}, no iter_XXXXXXX directory)")
        candidates, skipped = sorted(steps, reverse=True), [note]
    else:  # steps above the named one belong to a history a resumed run has left
        candidates, skipped = sorted({named, *(s for s in steps if s < named)}, reverse=True), []
    for step in candidates:
        problem = iteration_problem(iteration_dir(root, step))
        if problem is None:
            return step, iteration_dir(root, step), skipped
        skipped.append(f"iter_{step:07d} ({problem})")
    instead = otherwise or ("run without --load to start from --hf-checkpoint" if flag == "--load"
                            else f"give another {flag}")
    raise UserError(f"{flag} {root}: no valid checkpoint there: {'; '.join(skipped)}; {instead}")


def load_loop_state(iteration):
    with open(os.path.join(iteration, LOOP_STATE)) as f:
        return json.load(f)
