"""Each rollout engine's cores (vime/cpu_cores.py) against a direct enumeration of the node's cores."""
import itertools

import pytest

from vime.cpu_cores import cores_for_slot, threads_for, node_local_slots


def test_node_local_slots_count_the_engines_before_on_the_same_node():
    nodes = ["a", "b", "a", "c", "b", "a"]
    assert node_local_slots(nodes) == [sum(1 for m in nodes[:i] if m == n) for i, n in enumerate(nodes)]


@pytest.mark.parametrize("cores,threads", [({0, 1}, 1), ({0, 1, 2, 3}, 2), ({3, 5, 8, 9, 12, 13}, 3)])
def test_engines_of_a_node_get_disjoint_cores_while_there_are_enough(cores, threads):
    engines = len(cores) // threads
    given = [cores_for_slot(cores, slot, threads) for slot in range(engines)]
    assert all(len(g) == threads for g in given)
    assert set(itertools.chain(*given)) == cores  # every core used once: disjoint and complete


def test_more_engines_than_cores_share_and_an_engine_never_asks_for_more_cores_than_exist():
    assert cores_for_slot({0, 1}, 2, 1) == cores_for_slot({0, 1}, 0, 1)
    assert cores_for_slot({4, 7}, 0, 8) == [4, 7]


@pytest.mark.parametrize("cpus,threads", [(None, 1), (0.5, 1), (1, 1), (3, 3)])
def test_an_engine_computes_on_its_reserved_cpus_and_at_least_one(cpus, threads):
    assert threads_for(cpus) == threads
