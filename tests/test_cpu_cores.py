"""Each rollout engine's cores (vime/cpu_cores.py) against the OS: real processes bound to the cores an
engine is given, their affinity read back from the kernel, and a direct enumeration of the node's cores."""
import os
import subprocess
from collections import defaultdict

import pytest

from vime.cpu_cores import cores_for_slot, node_local_slots, threads_for

ALLOWED = os.sched_getaffinity(0)  # the cores this process (an engine's Ray worker) may run on


def kernel_affinity_of_bound_processes(core_lists):
    """Start one process per list, bind it to those cores and read back, from the kernel, the cores it
    may run on. The kernel keeps only cores that exist and this process may use, so a core that is not
    one of them shows up as missing (or, with none left, is refused)."""
    procs = [subprocess.Popen(["sleep", "30"]) for _ in core_lists]
    try:
        for proc, cores in zip(procs, core_lists):
            os.sched_setaffinity(proc.pid, cores)
        return [os.sched_getaffinity(proc.pid) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def engines_of_one_node(threads):
    """The cores each engine of a node full of `threads`-CPU engines computes on, as RolloutWorker binds them."""
    return [cores_for_slot(ALLOWED, slot, threads) for slot in range(len(ALLOWED) // threads)]


@pytest.mark.parametrize("threads", sorted({t for t in (1, 2, len(ALLOWED)) if t <= len(ALLOWED)}))
def test_engines_filling_a_node_run_on_disjoint_cores_that_cover_the_cores_the_os_allows(threads):
    bound = kernel_affinity_of_bound_processes(engines_of_one_node(threads))
    assert all(len(cores) == threads for cores in bound)  # every core given was one the OS allows
    assert set().union(*bound) == ALLOWED  # together they use every allowed core ...
    assert sum(map(len, bound)) == len(ALLOWED)  # ... each exactly once: no two engines share a core


def test_an_engine_that_reserves_more_cpus_than_the_node_has_runs_on_all_of_them_and_no_more():
    [bound] = kernel_affinity_of_bound_processes([cores_for_slot(ALLOWED, 0, len(ALLOWED) + 3)])
    assert bound == ALLOWED


def test_more_engines_than_cores_still_bind_to_cores_the_os_allows():
    core_lists = [cores_for_slot(ALLOWED, slot, 1) for slot in range(len(ALLOWED) + 2)]
    assert all(len(cores) == 1 for cores in kernel_affinity_of_bound_processes(core_lists))


@pytest.mark.parametrize("cores,threads", [({0, 1}, 1), ({0, 1, 2, 3}, 2), ({3, 5, 8, 9, 12, 13}, 3),
                                           ({13, 3, 9, 5, 12, 8}, 2)])
def test_engine_slots_take_the_nodes_cores_in_ascending_blocks_of_their_thread_count(cores, threads):
    ascending = sorted(cores)
    blocks = [ascending[i:i + threads] for i in range(0, len(ascending), threads)]
    assert [cores_for_slot(cores, slot, threads) for slot in range(len(blocks))] == blocks


def test_each_engine_counts_the_engines_before_it_on_its_own_node():
    nodes = ["a", "b", "a", "c", "b", "a"]
    slots = node_local_slots(nodes)
    per_node = defaultdict(list)
    for node, slot in zip(nodes, slots):
        per_node[node].append(slot)
    assert dict(per_node) == {"a": [0, 1, 2], "b": [0, 1], "c": [0]}


@pytest.mark.parametrize("cpus,threads", [(None, 1), (0.5, 1), (1, 1), (3, 3), (2.5, 2)])
def test_an_engine_computes_on_its_whole_reserved_cpus_and_at_least_one(cpus, threads):
    assert threads_for(cpus) == threads
