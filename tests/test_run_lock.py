"""One run at a time per --output-dir and --save: a second run is refused in one line naming the first
(pid, host, start time); a run that ends, however it ends (kill -9 included), frees them; on a file
system without locks the holder's record decides, a reused pid included."""
import errno
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.bad_input_helpers import refused
from tests.test_bad_inputs import args_for, ckpt  # noqa: F401  (ckpt: the bad-input tests' fixture)
from train_rl import prepare
from vime.cli_config import load_config
from vime.errors import UserError
from vime.run_lock import LOCK_FILE, DirLock, own_record

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def holder_named(pid):
    return f"is in use by another run (pid {pid} on host {socket.gethostname()}, started "


def test_a_second_run_on_the_output_dir_or_the_save_dir_is_refused_naming_the_first(ckpt, tmp_path):
    out, save = tmp_path / "out", tmp_path / "save"
    first = prepare(load_config(args_for(ckpt, out, "--save", save)))
    try:
        refused(args_for(ckpt, out), f"--output-dir {out} " + holder_named(os.getpid()),
                "wait for it to end or choose another --output-dir")
        refused(args_for(ckpt, tmp_path / "other", "--save", save), f"--save {save} " + holder_named(os.getpid()))
        prepare(load_config(args_for(ckpt, tmp_path / "other"))).release()  # the advice: another --output-dir
    finally:
        first.release()
    prepare(load_config(args_for(ckpt, out, "--save", save))).release()  # free once the first run ends


def test_one_directory_as_output_dir_and_save_is_locked_once(ckpt, tmp_path):
    prepare(load_config(args_for(ckpt, tmp_path, "--save", tmp_path))).release()


def test_a_run_killed_with_sigkill_frees_its_directory(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {REPO!r})
        from vime.run_lock import DirLock
        held = DirLock({str(tmp_path)!r}, "--output-dir")
        print("locked", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=re.escape(holder_named(holder.pid))):
            DirLock(str(tmp_path), "--output-dir")
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    DirLock(str(tmp_path), "--output-dir").release()


@pytest.fixture
def no_file_locks(monkeypatch):
    """A file system that refuses flock (Lustre mounted without `flock`): the record decides alone."""
    def refuse(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)


def write_record(directory, **changes):
    os.makedirs(directory, exist_ok=True)
    json.dump(dict(own_record(), **changes), open(os.path.join(directory, LOCK_FILE), "w"))


def test_without_file_locks_a_live_holder_refuses_and_a_dead_or_reused_pid_does_not(tmp_path, no_file_locks, capsys):
    first = DirLock(str(tmp_path / "a"), "--output-dir")  # this process's own record
    with pytest.raises(UserError, match=re.escape(holder_named(os.getpid()))):
        DirLock(str(tmp_path / "a"), "--output-dir")
    first.release()
    DirLock(str(tmp_path / "a"), "--output-dir").release()  # released: the record is cleared

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_record(tmp_path / "b", pid=int(ended.stdout))  # a process that has ended
    DirLock(str(tmp_path / "b"), "--output-dir").release()
    # a pid that runs again, but another process than the one that took the lock
    write_record(tmp_path / "c", process_start=own_record()["process_start"] - 3600)
    DirLock(str(tmp_path / "c"), "--output-dir").release()
    assert capsys.readouterr().out.count("has ended; taking it over") == 2


def test_without_file_locks_another_hosts_record_is_refused_until_removed_as_the_line_says(tmp_path, no_file_locks):
    write_record(tmp_path, host="node-7", pid=4242)
    with pytest.raises(UserError) as err:
        DirLock(str(tmp_path), "--save")
    message = str(err.value)
    assert "(pid 4242 on host node-7, started " in message and "\n" not in message
    path = message.rsplit("if it has, remove ", 1)[1]
    os.remove(path)  # the advice, as written
    DirLock(str(tmp_path), "--save").release()
