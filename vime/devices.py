"""Where a process computes, and whether two processes share a device.

Every Ray actor finds its own device: `torch.cuda.is_available()` inside it, never the cluster's
resource table (a Ray cluster that declares a logical GPU on a CPU-only machine runs on CPU). Two
actors share a device when they are on one node and Ray gave both a share of the same GPU (its
fractional GPUs: both see that GPU); on CPU that names a logical GPU, and what they share is the
node's memory. A trainer rank and an engine that share a device exchange weights in place
(trainer/weight_senders.py `InPlaceHandOver`): NCCL cannot join two processes on one GPU.

`phase_memory` is what a run logs of each phase's memory (the rollout, the training, and what each
side holds while the other works): device memory on CUDA, the resident set size on CPU.
"""
import torch


def device_identity(node_id, gpu_ids):
    """What an actor reports of where it computes: its node, the GPUs Ray assigned it (`ray.get_gpu_ids()`:
    logical ids, also on a CPU-only cluster that declares GPUs) and the device torch finds here."""
    return {"node": node_id, "gpus": sorted(str(g) for g in gpu_ids),
            "device": "cuda" if torch.cuda.is_available() else "cpu"}


def share_device(a, b):
    """Whether two actors' `device_identity` name one device: the same node and a GPU in common."""
    return a["node"] == b["node"] and bool(set(a["gpus"]) & set(b["gpus"]))


def reset_peak_memory():
    """A phase starts: its peak counts from here (CUDA; on CPU there is no per-phase peak to reset)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def phase_memory(phase, peak=True):
    """{metric: GiB} of this process at the end of `phase`. On CUDA the device memory torch allocated:
    its peak since `reset_peak_memory` (`memory/<phase>_peak_gib`) or, with peak False, what it holds
    now (`memory/<phase>_gib`). On CPU, where the device is the host, the process's resident set size
    now (`memory/<phase>_rss_gib`): the OS keeps no per-phase peak."""
    gib = 2 ** 30
    if torch.cuda.is_available():
        held = torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()
        return {f"memory/{phase}{'_peak' if peak else ''}_gib": held / gib}
    import psutil

    return {f"memory/{phase}_rss_gib": psutil.Process().memory_info().rss / gib}
