"""Reward functions: `--rm-type` registry, plus `--custom-rm-path module:function`.

A reward function takes (response text, label) and returns a float. A run scores a step's
samples through a scorer (`make_scorer`): in process for plain functions, in a process pool with a
bounded time per call for the `POOLED_REWARDS` (math verification can run unbounded).
"""
import importlib
import importlib.util

from rollout.task import tiny_add_reward
from vime.errors import UserError, require


def exact_match_reward(response, label):
    return 1.0 if response.strip() == str(label).strip() else 0.0


def math_reward(response, label):
    """math-verify's verdict in this process (no time bound: runs score it in a RewardPool)."""
    from rollout.math_reward import math_verify_score

    return math_verify_score(response, label)[0]


REWARDS = {
    "tiny_add": tiny_add_reward,
    "exact_match": exact_match_reward,
    "math": math_reward,
}
# rm types a run scores in worker processes, each call bounded by --reward-timeout
POOLED_REWARDS = {"math"}


class InProcessScorer:
    """Scores a batch with a plain reward function in the calling process (no extra metrics)."""

    def __init__(self, fn):
        self.fn = fn

    def score(self, pairs):
        return [float(self.fn(r, label)) for r, label in pairs], {}

    def close(self):
        pass


def make_scorer(rm_type, custom_rm_path=None, timeout=10.0, num_workers=2):
    """The run's batch scorer: a RewardPool for the pooled rm types, else the function in process."""
    fn = get_reward_fn(rm_type, custom_rm_path)
    if custom_rm_path is None and rm_type in POOLED_REWARDS:
        from rollout.math_reward import RewardPool

        return RewardPool(timeout, num_workers)
    return InProcessScorer(fn)


def load_custom_reward(path):
    """`module:function` -> the function, or a one-line error naming --custom-rm-path."""
    require(":" in path, f"--custom-rm-path {path!r}: expected module:function")
    module_name, func_name = path.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure of user code is the user's to fix
        raise UserError(f"--custom-rm-path {path!r}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    fn = getattr(module, func_name, None)
    require(callable(fn), f"--custom-rm-path {path!r}: {module_name} has no function {func_name}")
    return fn


def get_reward_fn(rm_type, custom_rm_path=None):
    if custom_rm_path:
        return load_custom_reward(custom_rm_path)
    if rm_type not in REWARDS:
        raise UserError(f"--rm-type {rm_type!r} is unknown; choose one of {sorted(REWARDS)} "
                        "or give --custom-rm-path module:function")
    if rm_type == "math":
        require(importlib.util.find_spec("math_verify") is not None,
                "--rm-type math needs math-verify: pip install math-verify")
    return REWARDS[rm_type]
