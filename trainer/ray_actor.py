"""`TrainerActor`: one rank of the TP x PP x DP trainer group as a Ray actor.

Every actor joins torch.distributed (gloo on CPU, NCCL on GPU) and holds a `Trainer`.
Trainer rank 0 also holds the run's weight senders (trainer/weight_senders.py), one per route: rank
0 of the group that pushes weights to the rollout workers, and the in-place hand-over to engines on
its own device.
"""
import os
import time

import ray
import torch

from trainer.batch import build_batch
from vime import weight_sync


def node_rendezvous():
    """(this node's IP as Ray sees it, a free port on it): where rank 0 of a group listens, so
    processes on other nodes (`--ray-address`) reach it; 127.0.0.1 only works on one node."""
    import ray.util

    from vime.net import free_port

    return ray.util.get_node_ip_address(), free_port("")


def _die_with_parent(main_thread):
    """In a process just forked from a trainer rank's thread `main_thread` (its actor calls run there):
    be killed when the rank dies (Linux's parent-death signal, which follows the forking thread, so only
    children of that long-lived thread ask for it). Why: megatron's checkpoint writers are forked and
    inherit the rank's connection to Ray's raylet; one left behind by a rank killed mid-save keeps that
    connection open, and Ray then never learns that the rank died (the driver would wait on it for good)."""
    import ctypes
    import signal
    import threading

    if threading.get_ident() != main_thread:
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: nothing to ask for
        return
    if os.getppid() != parent:  # the rank died before the request took hold
        os._exit(1)


class TrainerActorImpl:
    """Created first, then `start`ed on every rank with rank 0's `rendezvous()` address."""

    def __init__(self, rank, world_size, trainer_cfg, hf_checkpoint, load=None, threads=1):
        import functools
        import threading

        os.register_at_fork(after_in_child=functools.partial(_die_with_parent, threading.get_ident()))
        torch.set_num_threads(threads)
        self.rank, self.world_size = rank, world_size
        self.cfg, self.hf_checkpoint, self.load = trainer_cfg, hf_checkpoint, load
        self.trainer, self.ref_state, self.senders = None, None, {}

    def rendezvous(self):
        return node_rendezvous()

    def device_identity(self):
        """Where this rank computes (vime/devices.py): its node, its Ray GPUs, torch's device here."""
        from vime.devices import device_identity

        return device_identity(ray.get_runtime_context().get_node_id(), ray.get_gpu_ids())

    def start(self, master_addr, master_port):
        """Join the trainer group (collective over all ranks) and build the Trainer."""
        from trainer.distributed import init_distributed
        from trainer.trainer import Trainer

        trainer_cfg, hf_checkpoint, load = self.cfg, self.hf_checkpoint, self.load
        init_distributed(self.rank, self.world_size, master_addr, master_port, trainer_cfg.layout)
        self.trainer = Trainer(trainer_cfg, hf_checkpoint, load=load)
        self.ref_state = self._initial_policy(hf_checkpoint, load) if trainer_cfg.use_kl_loss else None
        return self.rank

    def _initial_policy(self, hf_checkpoint, load):
        """The KL reference: the policy the run started from, i.e. --hf-checkpoint's weights
        (after --load the model holds the resumed policy, which is not the reference)."""
        if load is None:
            return self._snapshot()
        from vime.models.hf_format import load_hf_checkpoint
        from trainer.weights import load_hf_state

        resumed = self._snapshot()
        _, hf_state, _ = load_hf_checkpoint(hf_checkpoint)
        load_hf_state(self.trainer.model, hf_state, self.trainer.model_cfg)
        initial = self._snapshot()
        self.trainer.model.load_state_dict(resumed, strict=False)
        return initial

    def _snapshot(self):
        return {k: v.detach().clone() for k, v in self.trainer.model.state_dict().items() if torch.is_tensor(v)}

    def _ref_logprobs(self, batch):
        """Log-probs under the initial (reference) weights, for the KL loss."""
        current = self._snapshot()
        self.trainer.model.load_state_dict(self.ref_state, strict=False)
        ref = self.trainer.compute_logprobs(batch)
        self.trainer.model.load_state_dict(current, strict=False)
        return ref

    def train(self, samples, num_steps):
        """`num_steps` optimizer steps over this rank's `samples`; metrics averaged over them, and the
        memory of the phase (vime/devices.py: its peak, and what the rank holds while the engines generate,
        with --offload-optimizer-state after the optimizer state went to the host, with --offload-train after
        the weights went too)."""
        from vime.devices import phase_memory, reset_peak_memory

        start = time.perf_counter()
        reset_peak_memory()
        self.trainer.onload()  # what waited on the host while the engines generated (nothing without offload)
        per_step = len(samples) // num_steps
        batches = [build_batch(samples[i * per_step:(i + 1) * per_step]) for i in range(num_steps)]
        if self.cfg.use_tis and num_steps > 1:  # pi_old for the updates after the first (which is its own pi_old)
            for batch in batches[1:]:
                batch.old_logprobs = self.trainer.compute_logprobs(batch)
        totals = {}
        for batch in batches:
            if self.ref_state is not None:
                batch.ref_logprobs = self._ref_logprobs(batch)
            for k, v in self.trainer.train_step(batch).items():
                totals[k] = totals.get(k, 0.0) + v / num_steps
        totals.update(phase_memory("train"))
        if self.cfg.offload_optimizer_state or self.cfg.offload_train:
            self.trainer.offload(weights=self.cfg.offload_train)
        totals.update(phase_memory("trainer_while_rolling_out", peak=False))
        totals["perf/train_time"] = time.perf_counter() - start
        return totals

    def _named_weights(self):
        """Collective (TP gather): (canonical HF name, tensor) of every weight, where the trainer holds it."""
        return [(k, v.detach()) for k, v in self.trainer.named_hf_weights()]

    def open_weight_sender(self, transport, plan, rendezvous, buffer_size):
        """Collective (TP gather). Rank 0 builds the sender of `transport` (trainer/weight_senders.py) for
        the engines' `plan`, joining the push group as its rank 0 when the transport has one (blocks
        until every engine joined), and returns the header each push carries to the engines; other
        ranks return None."""
        from trainer.weight_senders import SENDERS

        named = self._named_weights()
        if self.rank != 0:
            return None
        replaced = self.senders.get(transport)  # after an engine was lost: its group had a dead member
        if replaced is not None:
            weight_sync.abandon(getattr(replaced, "group", None))
        self.senders[transport] = SENDERS[transport](plan, rendezvous, buffer_size)
        return self.senders[transport].header(named)

    def send_weights(self, aborted=None):
        """Collective (TP gather); rank 0 pushes the weights from where they live (a GPU's never
        visit the host) through each of its senders and reports bytes, seconds, each transport's
        note for its engines and the checksums the engines must match. `aborted()`: whether the driver
        gave this push up (an engine was lost): a broadcast waiting on it ends then (PushBroken)."""
        named = self._named_weights()
        if self.rank != 0:
            return None
        start = time.perf_counter()
        sent, notes = 0, {}
        for transport, sender in self.senders.items():
            sender.aborted = aborted
            size, notes[transport] = sender.send(named)
            sent += size
        return {"bytes": sent, "seconds": time.perf_counter() - start, "notes": notes,
                "draft_checksum": weight_sync.checksum(_draft_part(named, self.trainer.model_cfg, True)),
                "target_checksum": weight_sync.checksum(_draft_part(named, self.trainer.model_cfg, False))}

    def weights_taken(self):
        """Every engine holds the push: the senders drop what they kept for it (the in-place buckets)."""
        for sender in self.senders.values():
            sender.release()

    def digests(self):
        """Collective (TP gather); rank 0: --check-weight-update-equal's sha256 of every tensor."""
        named = self._named_weights()
        return weight_sync.digests(named) if self.rank == 0 else None

    def save(self, path):
        self.trainer.save(path)
        return path


def _draft_part(named, model_cfg, draft):
    """The draft's tensors (draft True) or the target's."""
    from vime.models.draft_kinds import is_draft_name

    return [(k, v) for k, v in named if is_draft_name(k, model_cfg.num_hidden_layers) == draft]


TrainerActor = ray.remote(TrainerActorImpl)
