"""Atomic RL checkpoints: torch_dist model + optimizer (written by the trainers) and the loop state.

A checkpoint is written into `iter_XXXXXXX.tmp/`, renamed to `iter_XXXXXXX/` when complete,
and only then recorded in `latest_checkpointed_iteration.txt` (written to a temp file and
`os.replace`d). A crash mid-save leaves a `.tmp` directory and the previous checkpoint loadable.
The loop state is JSON (`loop_state.json`): loading it runs no code. The torch_dist model
directory's `.metadata` is a pickle by torch's design, so a checkpoint is trusted input.
"""
import errno
import json
import os
import pickle
import re
import shutil

from vime.errors import UserError, require

LATEST = "latest_checkpointed_iteration.txt"
LOCK = ".vime_save.lock"
LOOP_STATE = "loop_state.json"


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, read-only, ...); the partial .tmp was removed."""


def iteration_dir(root, step):
    return os.path.join(root, f"iter_{step:07d}")


def save(root, step, write_model, loop_state, keep=None):
    """write_model(path) writes the trainer checkpoint; loop_state (a JSON dict) is written beside it.
    keep: after the new checkpoint is the latest, remove all but the `keep` newest (None: keep all).

    A failure removes the partial `.tmp` (it would otherwise fill the disk) and raises
    CheckpointSaveError saying what happened; the previous checkpoint stays the latest."""
    final = iteration_dir(root, step)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        write_model(os.path.join(tmp, "model"))
        with open(os.path.join(tmp, LOOP_STATE), "w") as f:
            json.dump(loop_state, f)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(_save_failure(root, step, e)) from None
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    _write_latest(root, step)
    if keep:
        prune(root, keep)
    return final


def checkpoint_steps(root):
    """Steps of the complete checkpoints under root (iter_XXXXXXX directories, not .tmp), ascending."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(m.group(1)) for m in map(re.compile(r"iter_(\d{7})$").match, names) if m)


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
    cause = _root_cause(e)
    code = getattr(cause, "errno", None)
    free = shutil.disk_usage(root).free if os.path.isdir(root) else None
    if code == errno.ENOSPC or (free is not None and free < 64 * 1024 * 1024):
        what = f"the disk is full ({free or 0} bytes free)"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        what = "it is not writable"
    else:
        what = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
    return (f"--save {root}: writing the step-{step} checkpoint failed ({what}); removed the partial "
            f"{os.path.basename(iteration_dir(root, step))}.tmp; the previous checkpoint is intact: free space "
            "or choose another --save, then --load it")


def latest(root):
    """(step, iteration dir) of the newest complete checkpoint under root, or None.

    A damaged latest file is a one-line UserError naming --load."""
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            step = json.load(f)["step"]
        require(isinstance(step, int) and not isinstance(step, bool) and step >= 0, "bad step")
    except (ValueError, KeyError, TypeError, UserError):
        raise UserError(f"--load {root}: {LATEST} is damaged (expected {{\"step\": N}}); fix it to name "
                        "an existing iter_XXXXXXX directory") from None
    return step, iteration_dir(root, step)


def check_loadable(root):
    """(step, iteration dir) of --load's latest checkpoint, checked complete before any actor starts."""
    found = latest(root)
    require(found is not None, f"--load {root}: no complete checkpoint there ({LATEST} is missing)")
    step, iteration = found
    require(os.path.isdir(iteration), f"--load {root}: {LATEST} names step {step} but "
            f"{os.path.basename(iteration)}/ is missing; point {LATEST} at an existing iter_ directory")
    require(os.path.isfile(os.path.join(iteration, LOOP_STATE)),
            f"--load {root}: {os.path.basename(iteration)}/{LOOP_STATE} is missing; the checkpoint is incomplete")
    try:
        with open(os.path.join(iteration, LOOP_STATE)) as f:
            state = json.load(f)
        require(isinstance(state, dict) and isinstance(state.get("step"), int), "bad state")
    except (ValueError, UserError):
        raise UserError(f"--load {root}: {os.path.basename(iteration)}/{LOOP_STATE} is damaged (expected a JSON "
                        "object with an integer \"step\"); --load an earlier checkpoint") from None
    check_torch_dist_dir(os.path.join(iteration, "model"), f"--load {root}")
    return step, iteration


def check_torch_dist_dir(path, flag):
    """A torch_dist directory has its .metadata and every byte range it indexes (no truncated .distcp)."""
    meta_file = os.path.join(path, ".metadata")
    require(os.path.isfile(meta_file), f"{flag}: {meta_file} is missing; the checkpoint is incomplete or not "
            "a torch_dist checkpoint")
    try:
        with open(meta_file, "rb") as f:
            metadata = pickle.load(f)
        needed = {}
        for info in (metadata.storage_data or {}).values():
            end = info.offset + info.length
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    except Exception:  # the metadata is a pickle of torch's Metadata; anything else is damage
        raise UserError(f"{flag}: {meta_file} is unreadable; the checkpoint is damaged") from None
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        have = os.path.getsize(file) if os.path.isfile(file) else None
        require(have is not None and have >= size,
                f"{flag}: {file} is {'missing' if have is None else f'truncated ({have} of {size} bytes)'}; "
                "the checkpoint is damaged: --load an earlier one")


class SaveLock:
    """An exclusive lock on a --save directory for the life of the run (flock: freed when the process dies)."""

    def __init__(self, root):
        import fcntl

        os.makedirs(root, exist_ok=True)
        self.path = os.path.join(root, LOCK)
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "?"
            self.file.close()
            raise UserError(f"--save {root}: another run (pid {holder}) is writing checkpoints there; "
                            "wait for it to finish or choose another --save") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(str(os.getpid()))
        self.file.flush()

    def release(self):
        self.file.close()


def load_loop_state(iteration):
    with open(os.path.join(iteration, LOOP_STATE)) as f:
        return json.load(f)
