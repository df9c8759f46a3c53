"""A reward for end-to-end tests on random-weight models: gives varied rewards, so advantages
(and therefore policy updates) are non-zero even though such a model never solves the task."""


def parity_reward(response, label):
    return float(len(response) % 2)


def broken_import():
    raise RuntimeError("never called")


_CALLS = [0]


def dies_in_second_step(response, label):
    """parity_reward, but the process (the rollout manager) exits during step 1's rewards
    (16 samples per step in the tests): a real actor death, no mock."""
    import os

    _CALLS[0] += 1
    if _CALLS[0] > 16:
        os._exit(3)
    return parity_reward(response, label)


def parity_reward_on_odd_labels(response, label):
    """parity_reward for prompts whose answer is odd, 0 for the others: about half the groups
    carry no GRPO signal whatever the model says (dynamic sampling's negative control)."""
    return parity_reward(response, label) if int(label) % 2 else 0.0


def slow_on_hang(response, label):
    """A pooled scorer that never returns on the response "hang" (a verification that runs away)
    and scores like math-verify otherwise: the pool's timeout must cut it."""
    import time

    from rollout.math_reward import math_verify_score

    if response == "hang":
        time.sleep(3600)
    return math_verify_score(response, label)
