"""vLLM's console in a default run: its known start-up notices dropped, every other warning and
error kept, and the user's own VLLM_LOGGING_LEVEL left alone (rollout/vllm/quiet.py)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from rollout.vllm.quiet import KNOWN_NOTICES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a child process as vLLM's engine process is: it inherits the environment, configures vLLM's
# logging from it, then logs
CHILD = """
import logging, sys
from vllm.logger import _configure_vllm_root_logger, init_logger
_configure_vllm_root_logger()
log = init_logger("vllm.some.module")
for line in sys.argv[1:]:
    level, message = line.split(":", 1)
    log.log(getattr(logging, level), message)
"""


def _vllm_child_output(env, records):
    out = subprocess.run([sys.executable, "-c", CHILD, *records], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout + out.stderr


def _quiet_env(base):
    """The environment quiet_vllm_console leaves for the processes vLLM spawns."""
    code = "import os, json; from rollout.vllm.quiet import quiet_vllm_console; quiet_vllm_console(); print(json.dumps(dict(os.environ)))"
    import json

    out = subprocess.run([sys.executable, "-c", code], env=base, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _base_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    env["PYTHONPATH"] = REPO
    return env


def test_known_notices_dropped_other_warnings_and_errors_kept():
    known = KNOWN_NOTICES[0][0] + " (and the rest of vLLM's sentence)"
    records = [f"WARNING:{known}", "WARNING:an unexpected warning vLLM gives", f"ERROR:{known}",
               "INFO:an info line"]
    out = _vllm_child_output(_quiet_env(_base_env()), records)
    assert "an unexpected warning vLLM gives" in out
    assert out.count(KNOWN_NOTICES[0][0]) == 1 and "ERROR" in out  # the ERROR copy only
    assert "an info line" not in out


def test_a_level_the_user_set_is_left_alone():
    env = _base_env()
    env["VLLM_LOGGING_LEVEL"] = "INFO"
    quiet = _quiet_env(env)
    assert "VLLM_LOGGING_CONFIG_PATH" not in quiet
    known = KNOWN_NOTICES[0][0]
    out = _vllm_child_output(quiet, [f"WARNING:{known}", "INFO:an info line"])
    assert known in out and "an info line" in out


# a process logging on the logger vLLM warns on at `import vllm`, before vLLM reads its logging config
EARLY_CHILD = """
import logging, sys
from rollout.vllm.quiet import quiet_vllm_console
quiet_vllm_console()
logging.basicConfig()
for message in sys.argv[1:]:
    logging.getLogger("vllm.triton_utils.importing").warning(message)
"""


def test_a_process_inheriting_vimes_own_setup_still_drops_the_early_notices():
    """A Ray actor of a vime run, or a run started from a process that already set vLLM up quietly, inherits
    VLLM_LOGGING_CONFIG_PATH pointing at vime's config: that is not the user's choice, and the import-time
    notices (filtered per process, not through the environment) must still be dropped there."""
    known = next(start for start, _ in KNOWN_NOTICES if start.startswith("Triton is installed"))
    inherited = _quiet_env(_base_env())
    assert "VLLM_LOGGING_CONFIG_PATH" in inherited
    out = subprocess.run([sys.executable, "-c", EARLY_CHILD, known + ". Disabling Triton.", "an unexpected warning"],
                         env=inherited, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "an unexpected warning" in out.stderr and known not in out.stderr, out.stderr
