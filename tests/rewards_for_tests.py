"""A reward for end-to-end tests on random-weight models: gives varied rewards, so advantages
(and therefore policy updates) are non-zero even though such a model never solves the task."""


def parity_reward(response, label):
    return float(len(response) % 2)


def broken_import():
    raise RuntimeError("never called")
