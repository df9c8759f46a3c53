"""User-facing errors: one line that names the flag or file and says what to do.

Every bad input ends in `UserError`; entry points wrap `main` with `exit_on_user_error`
so the user sees `error: <message>` and exit code 2, never a traceback.
"""
import functools
import sys


class UserError(Exception):
    """Bad input from the user (a flag, a file, a config key)."""


def exit_on_user_error(main):
    """Decorate a CLI main: UserError -> one line on stderr and exit code 2."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapped


def require(condition, message):
    """Raise UserError(message) unless condition holds."""
    if not condition:
        raise UserError(message)
