"""Weight sync trainer -> rollout workers: buckets of HF-named tensors over a broadcast group, or
handed over in place to an engine on the trainer's own device.

The group is a standalone torch.distributed process group (gloo on CPU, NCCL on GPU)
between trainer rank 0 (rank 0 of the group) and every rollout worker; it does not touch
the trainer's own default group. Names and shapes never change during a run, so the
bucket layout is fixed once (`bucket_layout`); each sync then broadcasts flat buffers, built
where the trainer's tensors live (on a GPU they never visit the host).
An engine on the trainer's own device (a GPU they share, which NCCL cannot join twice, or the
same machine's memory on CPU) maps the same flat buckets instead (`fill_buckets`, `share` / `take_over`):
CUDA IPC handles on a GPU, shared-memory files on CPU, both torch.multiprocessing's reductions
pickled into bytes that Ray carries.
Checksums let the loop prove that a worker's weights equal the trainer's after a sync.

A broadcast whose peer died or stopped does not end by itself until gloo's timeout (minutes; the
other members wait as long): `send` and `receive` take an `aborted()` callable, asked about once a
second while a bucket is in flight, and give up with `PushBroken` when it says so (the driver
decides, having seen the peer go). The group is then unusable: its sockets and threads are left to
gloo's timeout (`abandon`) and the members meet in a new group.
"""
import ctypes
import datetime
import hashlib
import math
import pickle
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(minutes=5)
ABORT_POLL_S = 1.0  # how often a waiting broadcast asks whether the push was aborted
_ABANDONED = []  # groups given up on (see `abandon`): never freed, since freeing one waits for gloo's timeout


class PushBroken(RuntimeError):
    """A weight push ended early: a member of its group died, stopped, or the push was aborted; the
    group cannot be used again."""


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one synced tensor (the bucket layout is a list of these)."""

    name: str
    shape: tuple
    dtype: torch.dtype

    @property
    def numel(self):
        return math.prod(self.shape)


def bucket_layout(named_tensors, buffer_size):
    """[[TensorSpec]]: consecutive tensors of one dtype, at most `buffer_size` bytes a bucket
    (a larger tensor gets a bucket of its own)."""
    buckets, current, used = [], [], 0
    for name, t in named_tensors:
        size = t.numel() * t.element_size()
        if current and (used + size > buffer_size or current[-1].dtype != t.dtype):
            buckets.append(current)
            current, used = [], 0
        current.append(TensorSpec(name, tuple(t.shape), t.dtype))
        used += size
    if current:
        buckets.append(current)
    return buckets


def flatten_bucket(bucket, tensors_by_name):
    return torch.cat([tensors_by_name[s.name].reshape(-1).to(s.dtype) for s in bucket])


def unflatten_bucket(bucket, flat):
    out, offset = [], 0
    for s in bucket:
        out.append((s.name, flat[offset:offset + s.numel].view(s.shape)))
        offset += s.numel
    return out


def make_group(master_addr, master_port, rank, world_size, backend="gloo"):
    """A standalone process group for the broadcast (every member calls this at once)."""
    store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=TIMEOUT)
    prefix = dist.PrefixStore("vime_weight_sync", store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefix, rank, world_size)
    return dist.ProcessGroupGloo(prefix, rank, world_size, TIMEOUT)


def broadcast(group, tensor, aborted=None):
    """Broadcast from rank 0; with `aborted`, wait by polling and raise PushBroken once it says so."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    work = group.broadcast([tensor], opts)
    if aborted is not None:
        asked = time.monotonic()
        while not work.is_completed():
            time.sleep(0.001)
            if time.monotonic() - asked > ABORT_POLL_S:
                if aborted():
                    raise PushBroken("the weight push was aborted (a member of its group was lost)")
                asked = time.monotonic()
    try:
        work.wait()
    except RuntimeError as e:  # gloo: "Connection closed by peer", a timeout
        raise PushBroken(f"the weight push broke: {str(e).splitlines()[0][:200]}") from None
    return tensor


def abandon(group):
    """Give up on a group whose broadcast broke. Its destructor would wait for its threads, which end only at
    gloo's timeout, so it never runs: the group is kept referenced, and made immortal so that not even the
    interpreter's shutdown frees it (a process that healed from a lost member would otherwise wait out the
    timeout as it exits); the operating system reclaims its threads and sockets with the process."""
    if group is not None:
        _ABANDONED.append(group)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def device_for(backend):
    """NCCL moves CUDA tensors only; gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def backend_for(device):
    """The group backend that moves tensors living on `device` ("cuda": NCCL, "cpu": gloo)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def join_group(rendezvous, rank):
    """(group, device): join the broadcast group of `rendezvous` ({"master_addr", "master_port",
    "world_size", "device"}) at `rank`, with the backend that moves that device's tensors."""
    backend = backend_for(rendezvous["device"])
    group = make_group(rendezvous["master_addr"], rendezvous["master_port"], rank, rendezvous["world_size"], backend)
    return group, device_for(backend)


def send(group, layout, named_tensors, aborted=None):
    """Trainer rank 0: broadcast every bucket, each flattened on the device its tensors live on
    (CUDA tensors for NCCL, CPU ones for gloo: the group's backend was chosen for that device).
    Returns bytes sent."""
    by_name = dict(named_tensors)
    sent = 0
    for bucket in layout:
        flat = flatten_bucket(bucket, by_name)
        broadcast(group, flat, aborted)
        sent += flat.numel() * flat.element_size()
    return sent


def receive(group, layout, device="cpu", aborted=None, progressed=None):
    """Rollout worker: yield (name, tensor) for every bucket as it arrives (on `device`);
    `progressed()` after each (the worker's sign of life)."""
    for bucket in layout:
        flat = torch.empty(sum(s.numel for s in bucket), dtype=bucket[0].dtype, device=device)
        broadcast(group, flat, aborted)
        if progressed is not None:
            progressed()
        yield from unflatten_bucket(bucket, flat)


def share(tensors):
    """Bytes from which another process on this machine maps `tensors` without copying them: CUDA IPC
    handles of CUDA tensors, shared-memory file names of CPU ones (a CPU tensor not yet in shared
    memory is moved there). The tensors must stay alive until the other side has mapped them."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp  # registers torch's reductions with ForkingPickler

    # file names travel through Ray; the default strategy's file descriptors only through a
    # multiprocessing connection of the same process tree
    mp.set_sharing_strategy("file_system")
    return bytes(ForkingPickler.dumps(tensors))


def mapped(blob):
    """What `share` shared, mapped into this process (the same memory, not a copy)."""
    import torch.multiprocessing  # noqa: F401  (the rebuild functions the bytes name)

    return pickle.loads(blob)


def fill_buckets(layout, named_tensors, buckets=None):
    """The flat buckets of `layout`, where the tensors live, for the in-place hand-over: written into
    `buckets` (an earlier push's, reused) when given, else new ones (on CPU in shared memory, so that
    sharing them copies nothing). The tensors may come from any gathering of the trainer's shards."""
    by_name = dict(named_tensors)
    out = []
    for i, bucket in enumerate(layout):
        parts = [by_name[s.name].reshape(-1).to(s.dtype) for s in bucket]
        flat = buckets[i] if buckets else torch.empty(sum(s.numel for s in bucket), dtype=bucket[0].dtype,
                                                     device=parts[0].device)
        if flat.device.type == "cpu" and not flat.is_shared():
            flat.share_memory_()
        torch.cat(parts, out=flat)
        out.append(flat)
    if out and out[0].device.type == "cuda":
        torch.cuda.current_stream().synchronize()  # the engine reads them from another process
    return out


def take_over(layout, blob):
    """Engine side: (name, tensor) of every bucket `share` shared, views of the trainer's memory."""
    for bucket, flat in zip(layout, mapped(blob)):
        yield from unflatten_bucket(bucket, flat)


def tensor_stats(tensor):
    """float64 [sum, sum of squares] of one tensor: the per-tensor part of `checksum`."""
    td = tensor.detach().double()
    return torch.stack([td.sum(), (td * td).sum()]).cpu()  # tensors may live on the GPU


def checksum_from_stats(stats_by_name):
    """Sum of per-tensor stats in name order: equal inputs give bit-equal checksums."""
    total = torch.zeros(2, dtype=torch.float64)
    for name in sorted(stats_by_name):
        total += stats_by_name[name]
    return total.tolist()


def checksum(named_tensors):
    """Cheap order-independent fingerprint: float64 sums of values and squares per tensor."""
    return checksum_from_stats({name: tensor_stats(t) for name, t in named_tensors})


def tensor_bytes(tensor):
    """The raw bytes of a tensor of any dtype (numpy has no bf16, so they are read as uint8)."""
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def digests(named_tensors):
    """{name: sha256 of the bytes}: the full comparison of --check-weight-update-equal (in the
    synced dtype: the bf16 bit patterns under --bf16)."""
    return {name: hashlib.sha256(tensor_bytes(t)).hexdigest() for name, t in named_tensors}
