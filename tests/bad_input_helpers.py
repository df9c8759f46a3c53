"""What every bad-input test asserts: preflight raises one UserError line holding the needles."""
import pytest

from orchestration.preflight import preflight
from vime.cli_config import load_config
from vime.errors import UserError


def refused(argv, *needles):
    with pytest.raises(UserError) as err:
        preflight(load_config(argv))
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message
