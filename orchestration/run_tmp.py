"""The run's own temp directory: everything the run's processes put in the system temp dir (vLLM's
IPC sockets, wandb's media and artifact staging, tempfile users in the actors) goes into one
`vime-*` directory that the run removes on every exit it controls (success, error, signal).

Ray keeps its own temp dir (its session directories, sockets included, whose paths must stay
short): RAY_TMPDIR pins it to where Ray would have put it anyway.
"""
import os
import shutil
import tempfile

# the variables the run's processes (the driver, and the actors through the raylet it starts) read
REDIRECTED = ("TMPDIR", "VLLM_RPC_BASE_PATH")


class RunTempDir:
    """Creates the directory and points TMPDIR (and vLLM's IPC base) at it until `remove`."""

    def __init__(self):
        self.saved_env = {k: os.environ.get(k) for k in (*REDIRECTED, "RAY_TMPDIR")}
        self.saved_tempdir = tempfile.tempdir
        ray_tmp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"  # Ray's own default
        self.path = tempfile.mkdtemp(prefix="vime-")
        os.environ["RAY_TMPDIR"] = ray_tmp
        for key in REDIRECTED:
            os.environ[key] = self.path
        tempfile.tempdir = self.path

    def remove(self):
        shutil.rmtree(self.path, ignore_errors=True)
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        tempfile.tempdir = self.saved_tempdir
