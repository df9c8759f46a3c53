"""Networking helpers shared by the trainer, the rollout workers, tests and benchmarks."""
import socket


def free_port(host="127.0.0.1"):
    """A TCP port free on `host` now: 127.0.0.1 for single-machine rendezvous (tests, benchmarks,
    one-process tools); "" (every interface) where processes on other nodes must reach it."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
