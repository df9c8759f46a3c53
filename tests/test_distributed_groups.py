"""Rebuilding megatron's layout in one process leaves no process group (and no gloo thread) behind.

megatron-core's `destroy_model_parallel` forgets the groups it built without destroying them; a process that
rebuilds its layout (a test session, a tool converting several checkpoints) would keep every gloo group's
threads alive until exit. The reference is the kernel's own count of the process's threads."""
import os

import torch.distributed as dist

from trainer.distributed import init_single_process, owned_single_process


def live_threads():
    return len(os.listdir("/proc/self/task"))


def live_groups():
    return len(dist.distributed_c10d._world.pg_map)


def test_rebuilding_the_layout_keeps_the_groups_and_threads_of_one_build():
    init_single_process()
    groups, threads = live_groups(), live_threads()
    for _ in range(5):
        init_single_process()
    with owned_single_process():
        pass
    assert live_groups() == groups
    # every gloo group holds at least one thread of its own, so one leaked layout alone would add `groups`
    # threads; fewer than that leaves room for a pool thread torch may start meanwhile
    assert live_threads() < threads + groups
