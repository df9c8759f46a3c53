"""wandb as its users set it: --wandb-mode > WANDB_MODE > a key being set; an online start that
fails (no route to the server, a bad key) is one warning line and the run logs offline (real wandb,
each case in its own process: wandb keeps global state)."""
import os
import socket
import subprocess
import sys

import pytest

from vime.config import RunSection
from vime.run_logger import wandb_mode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "k" * 40  # the length wandb accepts; no server ever sees it (see closed_port)


@pytest.mark.parametrize("flag, env_mode, key, expected", [
    (None, None, None, "offline"),
    (None, None, KEY, "online"),           # a key alone: the user logs in
    (None, "offline", KEY, "offline"),     # wandb's own switch wins over the key
    (None, "disabled", KEY, "disabled"),
    (None, "online", None, "online"),
    ("offline", "online", KEY, "offline"),  # the flag wins over both
    ("online", "offline", None, "online"),
])
def test_mode_precedence_is_flag_then_wandb_mode_then_a_key(monkeypatch, flag, env_mode, key, expected):
    for name, value in (("WANDB_MODE", env_mode), ("WANDB_API_KEY", key)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert wandb_mode(RunSection(wandb_mode=flag)) == expected


def closed_port():
    """A loopback port nothing listens on (bound, then released): connecting is refused at once."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def log_one_step(out, **env_vars):
    """A RunLogger in a fresh process, one step logged; (process, the wandb run's mode)."""
    code = ("import sys; from vime.config import RunSection; from vime.run_logger import RunLogger\n"
            f"lg = RunLogger(RunSection(output_dir={str(out)!r}), {{'a': 1}}); lg.log(0, {{'x': 1.0}})\n"
            "mode = lg.wandb.settings.mode; lg.finish(); print('MODE', mode)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=REPO, WANDB_BASE_URL=f"http://127.0.0.1:{closed_port()}", **env_vars)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mode = [x.split()[1] for x in proc.stdout.splitlines() if x.startswith("MODE ")]
    return proc, mode[0]


def offline_runs(out):
    return [d for d in os.listdir(os.path.join(out, "wandb")) if d.startswith("offline-run-")]


def test_wandb_mode_offline_with_a_key_set_logs_offline(tmp_path):
    proc, mode = log_one_step(tmp_path, WANDB_MODE="offline", WANDB_API_KEY=KEY)
    assert mode == "offline" and len(offline_runs(tmp_path)) == 1
    assert "warning:" not in proc.stderr  # offline by choice: nothing to warn about


@pytest.mark.parametrize("key, cause", [pytest.param(KEY, "CommError", marks=pytest.mark.slow),  # waits out a timeout
                                        ("short", "AuthenticationError")],
                         ids=["unreachable-server", "bad-key"])
def test_a_failed_online_start_is_one_warning_and_the_run_logs_offline(tmp_path, key, cause):
    proc, mode = log_one_step(tmp_path, WANDB_API_KEY=key, WANDB_INIT_TIMEOUT="3")
    warnings = [x for x in proc.stderr.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 1 and cause in warnings[0] and "logging offline" in warnings[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert mode == "offline" and len(offline_runs(tmp_path)) == 1  # `wandb sync` can upload it later
    assert any(f.endswith(".wandb") for f in os.listdir(os.path.join(tmp_path, "wandb", offline_runs(tmp_path)[0])))
