"""Path checks shared by the CLIs (one-line UserErrors naming the flag): a path given at all, an input
that is the directory or file it should be (saying what is there instead), an output directory that
accepts files."""
import os
import tempfile

from vime.errors import UserError, require


def _named(path, flag):
    """How a message names the path: after its flag, or alone for a positional argument (flag None)."""
    return f"{flag} {path}" if flag else f"{path}"


def require_given(path, flag):
    """`flag` was given a path, not an empty string (which names no file: the current directory to some
    calls, nothing to others)."""
    require(path is None or str(path).strip() != "", f"{_named(repr(path), flag)}: an empty path names no file; give a path")


def require_dir(path, flag, then=""):
    """`path` is a directory; else one line saying what is there (nothing, or a file), then `then`."""
    require_given(path, flag)
    if path is None or not os.path.isdir(path):
        there = path is not None and os.path.exists(path)
        raise UserError(f"{_named(path, flag)}: {'a file, not a directory' if there else 'no such directory'}{then}")


def require_file(path, flag, then=""):
    """`path` is a file; else one line saying what is there (nothing, or a directory), then `then`."""
    require_given(path, flag)
    if path is None or not os.path.isfile(path):
        there = path is not None and os.path.isdir(path)
        raise UserError(f"{_named(path, flag)}: {'a directory, not a file' if there else 'no such file'}{then}")


def require_writable_dir(path, flag):
    """The directory (or the nearest existing parent it will be created in) accepts a new file."""
    require_given(path, flag)
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
    require_given(path, flag)
    if os.path.isdir(path):
        entries = sorted(os.listdir(path))
        require(not entries, f"{flag} {path}: the directory is not empty ({len(entries)} entries, first: "
                f"{entries[0] if entries else ''}); choose a new or empty directory")
    require_writable_dir(path, flag)


def same_dir(a, b):
    return os.path.realpath(a) == os.path.realpath(b)


def require_not_an_input(out, out_flag, inputs):
    """An output that is one of the command's inputs, or lies inside an input directory, would be
    written over it: one line naming both. `inputs`: [(path or None, its flag)]."""
    require_given(out, out_flag)
    real_out = os.path.realpath(out)
    for path, flag in inputs:
        if not path:
            continue
        real_in = os.path.realpath(path)
        where = "is" if real_out == real_in else "lies inside" if real_out.startswith(real_in + os.sep) else None
        require(where is None, f"{out_flag} {out} {where} {flag} {path}: writing there would overwrite the input; "
                f"choose another {out_flag}")
