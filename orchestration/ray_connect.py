"""Whether a Ray cluster answers at `--ray-address`, decided within `--ray-connect-timeout` seconds.

Left to itself, `ray.init(address=...)` at an address where no Ray head listens retries for many
minutes and prints Ray's C++ connection warnings all the while. Before the driver joins, two checks
bounded by one deadline stop the run with one line naming the flags and what to check:

1. a plain TCP connect to the address, retried until the deadline (a head that is still starting
   comes up in time; nothing listening prints nothing);
2. Ray's own GCS client, in a child process killed at the deadline, so that a port that answers but
   is not a Ray head (the dashboard's, a typo that hits another service) or refuses the token ends
   the same way, its retry warnings captured rather than printed.

`auto` (Ray finds the cluster itself) is left to Ray. A `ray://` address is Ray Client's server,
not the GCS: only the TCP check applies.

Without `--ray-address` a run starts a Ray instance of its own (`ray.init(address="local")`), whatever
else runs on the machine: Ray's own default would join the cluster named in its temp dir's
`ray_current_cluster`, which any `ray start` leaves behind, even one that has ended. `RAY_ADDRESS` in
the environment (Ray's way of naming a cluster, set by `ray job submit`) does not choose for the run:
left unset, empty or `local` the run starts its own Ray; naming a cluster without `--ray-address` is
refused in one line (`check_ray_address_env`), as joining it silently, or ignoring it silently, would
each surprise someone.
"""
import os
import socket
import subprocess
import sys
import time

from vime.errors import UserError, require

CLIENT_SCHEME = "ray://"
CLIENT_DEFAULT_PORT = 10001  # Ray Client's server on the head
RETRY_SECONDS = 0.5
WHAT_TO_CHECK = ("check that `ray start --head` runs on that host, that the port is its GCS port "
                 "(6379 unless `ray start --port` said otherwise) and, with token authentication, that "
                 "RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH holds the cluster's token")
# Run by the child: connect Ray's GCS client and say, in one line, why it could not
GCS_PROBE = """
import sys
try:
    from ray._raylet import GcsClient
    GcsClient(address=sys.argv[1]).cluster_id
except Exception as e:
    print(f"{type(e).__name__}: {e}".splitlines()[0])
    sys.exit(1)
"""


LOCAL = "local"  # Ray's address for "start a new instance in this process's session"


def check_ray_address_env(ray_address):
    """Without --ray-address, RAY_ADDRESS must not name a cluster (the run would start its own Ray
    and leave that cluster aside: said in one line instead)."""
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if ray_address or env in ("", LOCAL):
        return
    # an http(s) address is a head's dashboard, which `ray job submit` talks to: no cluster to join
    join = ("give --ray-address HEAD:6379 (the head's GCS address) to join its cluster"
            if env.startswith(("http://", "https://")) else f"pass --ray-address {env} to join that cluster")
    raise UserError(f"RAY_ADDRESS={env} is set, but a run joins a Ray cluster only with --ray-address: {join}, "
                    "or unset RAY_ADDRESS to start a Ray of the run's own")


def check_ray_address(address, timeout):
    """Raise a one-line UserError unless a Ray cluster answers at `address` within `timeout` seconds."""
    if address == "auto":
        return
    deadline = time.monotonic() + timeout
    host, port, is_client = split_address(address)
    within = f"within --ray-connect-timeout {timeout:g} s"
    require(tcp_answers(host, port, deadline, address),
            f"--ray-address {address}: nothing accepted a connection {within}; {WHAT_TO_CHECK}")
    if not is_client:
        problem = gcs_problem(address, deadline, within)
        require(problem is None, f"--ray-address {address}: {problem}; {WHAT_TO_CHECK}")


def split_address(address):
    """(host, port, is Ray Client) of `host:port`, `[ipv6]:port` or `ray://host[:port]`."""
    is_client = address.startswith(CLIENT_SCHEME)
    rest = address[len(CLIENT_SCHEME):] if is_client else address
    host, colon, port = rest.rpartition(":")
    if not colon and is_client:
        host, port = rest, str(CLIENT_DEFAULT_PORT)
    require(host and port.isdigit() and 0 < int(port) < 65536,
            f"--ray-address {address!r}: give the head's host:port (its GCS port, 6379 by default), "
            "ray://host:port for Ray Client, or auto")
    return host.strip("[]"), int(port), is_client


def tcp_answers(host, port, deadline, address):
    """Whether something accepts a TCP connection at host:port before `deadline` (retried while refused)."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            socket.create_connection((host, port), timeout=remaining).close()
            return True
        except socket.gaierror as e:
            raise UserError(f"--ray-address {address}: host {host!r} not found ({e.strerror}); "
                            "give the Ray head's host name or IP") from None
        except OSError:
            time.sleep(min(RETRY_SECONDS, max(0.0, deadline - time.monotonic())))


def gcs_problem(address, deadline, within):
    """None when Ray's GCS client connects to `address` before `deadline`, else what went wrong."""
    try:
        probe = subprocess.run([sys.executable, "-c", GCS_PROBE, address], capture_output=True, text=True,
                               timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return f"its port is open but no Ray head replied {within}"
    if probe.returncode == 0:
        return None
    reason = (probe.stdout.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
    return f"the Ray head refused the connection ({first_sentence(reason)})"


def first_sentence(text):
    return text.split(". ")[0].rstrip(".")
