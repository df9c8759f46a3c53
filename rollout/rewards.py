"""Reward functions: `--rm-type` registry, plus `--custom-rm-path module:function`.

A reward function takes (response text, label) and returns a float.
"""
import importlib

from rollout.task import tiny_add_reward
from vime.errors import UserError, require


def exact_match_reward(response, label):
    return 1.0 if response.strip() == str(label).strip() else 0.0


REWARDS = {
    "tiny_add": tiny_add_reward,
    "exact_match": exact_match_reward,
}


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
    return REWARDS[rm_type]
