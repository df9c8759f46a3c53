"""Output-directory checks shared by the CLIs (one-line UserErrors naming the flag)."""
import os
import tempfile

from vime.errors import UserError, require


def require_writable_dir(path, flag):
    """The directory (or the nearest existing parent it will be created in) accepts a new file."""
    probe_dir = os.path.abspath(path)
    while not os.path.isdir(probe_dir):
        require(not os.path.exists(probe_dir), f"{flag} {path}: {probe_dir} exists and is not a directory")
        probe_dir = os.path.dirname(probe_dir)
    try:  # a real write: permission bits do not tell for root or read-only mounts
        with tempfile.TemporaryFile(dir=probe_dir):
            pass
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write in {probe_dir} ({e.strerror}); choose a writable "
                        "directory") from None


def require_new_or_empty_dir(path, flag):
    """A converter's output must not mix with files already there."""
    if os.path.isdir(path):
        entries = sorted(os.listdir(path))
        require(not entries, f"{flag} {path}: the directory is not empty ({len(entries)} entries, first: "
                f"{entries[0] if entries else ''}); choose a new or empty directory")
    require_writable_dir(path, flag)


def same_dir(a, b):
    return os.path.realpath(a) == os.path.realpath(b)
