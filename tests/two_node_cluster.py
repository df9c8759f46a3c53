"""A two-node Ray cluster on this host for tests: `ray start --head` plus `ray start --address`,
each with its own temp dir and a custom resource that names it, both with token auth.

Each node is a `ray start --block` in its own session, so stopping it (or killing one node's
raylet) touches only this cluster's processes, never another Ray running on the machine."""
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoNodeCluster:
    """head: `head_resources`; second node: `node_resources` (None: the head alone); `env` reaches it
    (token included). `gpus`: logical GPUs the head declares (`ray start --num-gpus`), also on a
    machine without any."""

    def __init__(self, head_resources, node_resources, cpus=2, gpus=0):
        self.gpus = gpus
        # a short root: Ray's unix sockets live under it and their paths must stay under 108 bytes
        self.root, self.port = tempfile.mkdtemp(prefix="vime-ray-"), free_port()
        self.env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        self.env.pop("RAY_ADDRESS", None)
        self.address = f"127.0.0.1:{self.port}"
        self.head = self._start("head", ["--head", "--port", str(self.port), "--include-dashboard", "true",
                                         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(free_port())],
                                cpus, head_resources)
        self._wait_nodes(1)
        self.node = None
        if node_resources is None:
            return
        self.node = self._start("node", ["--address", self.address], cpus, node_resources)
        self._wait_nodes(2)

    def _start(self, name, args, cpus, resources):
        import json

        log = open(os.path.join(self.root, f"{name}.log"), "w")
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--node-ip-address", "127.0.0.1",
               "--num-cpus", str(cpus), "--num-gpus", str(self.gpus if name == "head" else 0),
               "--resources", json.dumps(resources), "--temp-dir",
               os.path.join(self.root, name), "--disable-usage-stats", *args]
        return subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_nodes(self, count, timeout=120):
        code = ("import ray; ray.init(address=%r, log_to_driver=False); "
                "print(sum(n['Alive'] for n in ray.nodes()))" % self.address)
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                proc = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True,
                                      timeout=60)
            except subprocess.TimeoutExpired:
                continue
            if proc.returncode == 0 and proc.stdout.strip().splitlines()[-1:] == [str(count)]:
                return
            time.sleep(2)
        raise RuntimeError(f"the cluster did not reach {count} nodes: {open(os.path.join(self.root, 'head.log')).read()[-2000:]}")

    def node_raylet(self):
        """The second node's raylet process."""
        for child in psutil.Process(self.node.pid).children(recursive=True):
            if child.name() == "raylet":
                return child
        raise RuntimeError("the second node has no raylet")

    def processes(self):
        """Every process of this cluster: the two `ray start`s, their children, and any process
        started for it that names one of its temp dirs (workers re-parented by a dead raylet)."""
        found = {}
        for starter in filter(None, (self.head, self.node)):
            try:
                p = psutil.Process(starter.pid)
                found[p.pid] = p
                found.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.NoSuchProcess:
                pass
        for p in psutil.process_iter(["cmdline"]):
            if any(self.root in part for part in (p.info["cmdline"] or [])):
                found[p.pid] = p
        return list(found.values())

    def stop(self):
        procs = self.processes()
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=15)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(self.root, ignore_errors=True)
