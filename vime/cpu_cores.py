"""Which CPU cores a rollout engine computes on, so that engines sharing a node do not share cores.

An engine reserves `--rollout-num-cpus-per-engine` CPUs in its Ray bundle, but Ray does not pin
processes, and vLLM's CPU build binds its OpenMP threads itself: left to its automatic choice,
every engine on a node binds to the same cores and two engines run slower than one. Each
engine instead gets its node-local slot (the how-many-th engine on its node) and takes the next
`threads` cores of the cores its process may use. Engines and trainer ranks compute with as many
torch threads as CPUs their bundle reserved.
"""


def node_local_slots(node_ids):
    """For each engine's node id, how many engines before it are on the same node."""
    return [node_ids[:i].count(node) for i, node in enumerate(node_ids)]


def threads_for(cpus):
    """Compute threads of an actor that reserved `cpus` CPUs (a fraction or none still computes on one)."""
    return max(1, int(cpus or 0))


def cores_for_slot(allowed, slot, threads):
    """`threads` consecutive cores of the sorted `allowed` set for node-local `slot`, wrapping around
    when the node has fewer cores than its engines reserve (they then share, as they would anyway)."""
    cores = sorted(allowed)
    threads = min(threads, len(cores))
    start = (slot * threads) % len(cores)
    return [cores[(start + j) % len(cores)] for j in range(threads)]
