"""One run at a time per directory: the lock a run holds on its --output-dir and its --save.

A run takes an exclusive `flock(2)` on `DIR/.vime_run.lock` before it writes anything there and
keeps it until it exits. The kernel frees that lock when the holding process ends, however it
ends (kill -9 included), so a dead run never blocks the next one, and a PID the system hands to
another process later holds nothing. On NFS the lock is taken through the server (NFSv4, or NFSv3
with lockd), so a run on another host that shares the directory is refused too; the server frees
it when the holder's host stops renewing its lease.

The file also holds a record of the holder (pid, host, start time) that a refused run names. On a
file system without locks (flock fails with ENOLCK or EOPNOTSUPP, e.g. Lustre mounted without
`flock`) the record decides alone: a holder on this host counts as alive while its pid runs the
process that started at the recorded time (a reused pid does not); a holder on another host cannot
be checked from here, so it stays the holder until its record is removed (the refusal says how).
"""
import errno
import fcntl
import json
import os
import socket
import time

import psutil

from vime.errors import UserError

LOCK_FILE = ".vime_run.lock"
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # flock refused by the file system itself


def own_record():
    """What a holder writes: its pid, host, start time (readable) and process start time (for pid reuse)."""
    me = psutil.Process()
    return {"pid": me.pid, "host": socket.gethostname(), "process_start": me.create_time(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(me.create_time()))}


def describe(record):
    """'pid 123 on host h, started 2026-11-27 04:33:46 UTC' (or what the record holds of it)."""
    if not record:
        return "its pid not yet recorded"
    return f"pid {record.get('pid', '?')} on host {record.get('host', '?')}, started {record.get('started', '?')}"


def alive_here(record):
    """Whether the record's holder is a running process of this host (the same process: same start time)."""
    try:
        return abs(psutil.Process(record["pid"]).create_time() - record["process_start"]) < 1e-3
    except (psutil.Error, KeyError, TypeError):
        return False


class DirLock:
    """The lock of one directory for the life of this process's run (see the module docstring)."""

    def __init__(self, directory, flag):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, LOCK_FILE)
        self.directory, self.flag = directory, flag
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read()
            self.file.close()
            raise self._refusal(holder) from None
        except OSError as e:
            if e.errno not in NO_LOCKS:
                raise
            self._take_by_record()
        self._write(own_record())

    def _take_by_record(self):
        """On a file system without locks: take the directory unless its record names a live holder."""
        holder = self._read()
        if not holder:
            return
        if holder.get("host") != socket.gethostname():
            self.file.close()
            raise self._refusal(holder, f"; this file system has no locks, so whether that run has ended cannot be "
                                        f"checked from here: if it has, remove {self.path}")
        if alive_here(holder):
            self.file.close()
            raise self._refusal(holder)
        print(f"[vime] {self.flag} {self.directory}: the run that held it ({describe(holder)}) has ended; "
              "taking it over", flush=True)

    def _refusal(self, holder, more=""):
        return UserError(f"{self.flag} {self.directory} is in use by another run ({describe(holder)}): wait for it to "
                         f"end or choose another {self.flag}{more}")

    def _read(self):
        self.file.seek(0)
        try:
            record = json.loads(self.file.read() or "null")
        except ValueError:  # a record cut short by a crash: no holder is named
            return None
        return record if isinstance(record, dict) else None

    def _write(self, record):
        self.file.seek(0)
        self.file.truncate()
        self.file.write(json.dumps(record))
        self.file.flush()
        os.fsync(self.file.fileno())

    def release(self):
        """Clear the record and free the lock (the file stays: removing it could let two runs lock two files)."""
        if self.file.closed:
            return
        self.file.seek(0)
        self.file.truncate()
        self.file.close()


class RunLocks:
    """The locks of a run's directories (--output-dir, --save), each real directory once."""

    def __init__(self, dirs):
        """dirs: [(flag, directory or None)]; a directory named by two flags is locked once."""
        self.locks, seen = [], set()
        try:
            for flag, directory in dirs:
                real = os.path.realpath(directory) if directory else None
                if real and real not in seen:
                    seen.add(real)
                    self.locks.append(DirLock(directory, flag))
        except BaseException:
            self.release()
            raise

    def release(self):
        for lock in reversed(self.locks):
            lock.release()
