"""What every bad-input test asserts: train_rl.prepare (what main runs before Ray starts) raises one UserError line holding the needles."""
import pytest

from train_rl import prepare
from vime.cli_config import load_config
from vime.errors import UserError


def refused(argv, *needles):
    with pytest.raises(UserError) as err:
        prepare(load_config(argv))
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message
