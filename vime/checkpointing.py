"""Atomic RL checkpoints: torch_dist model + optimizer (written by the trainers) and the loop state.

A checkpoint is written into `iter_XXXXXXX.tmp/`, renamed to `iter_XXXXXXX/` when complete,
and only then recorded in `latest_checkpointed_iteration.txt` (written to a temp file and
`os.replace`d). A crash mid-save leaves a `.tmp` directory and the previous checkpoint loadable.
"""
import json
import os
import pickle
import shutil

LATEST = "latest_checkpointed_iteration.txt"


def iteration_dir(root, step):
    return os.path.join(root, f"iter_{step:07d}")


def save(root, step, write_model, loop_state):
    """write_model(path) writes the trainer checkpoint; loop_state is pickled beside it."""
    final = iteration_dir(root, step)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write_model(os.path.join(tmp, "model"))
    with open(os.path.join(tmp, "loop_state.pkl"), "wb") as f:
        pickle.dump(loop_state, f)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    _write_latest(root, step)
    return final


def _write_latest(root, step):
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({"step": step}))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))


def latest(root):
    """(step, iteration dir) of the newest complete checkpoint under root, or None."""
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    step = json.load(open(path))["step"]
    return step, iteration_dir(root, step)


def load_loop_state(iteration):
    with open(os.path.join(iteration, "loop_state.pkl"), "rb") as f:
        return pickle.load(f)
