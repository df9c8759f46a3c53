"""`TrainerActor`: one rank of the TP x PP x DP trainer group as a Ray actor.

Every actor joins torch.distributed (gloo on CPU, NCCL on GPU) and holds a `Trainer`.
Trainer rank 0 is also rank 0 of the weight-sync broadcast group to the rollout workers.
"""
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


class TrainerActorImpl:
    """Created first, then `start`ed on every rank with rank 0's `rendezvous()` address."""

    def __init__(self, rank, world_size, trainer_cfg, hf_checkpoint, load=None, threads=1):
        torch.set_num_threads(threads)
        self.rank, self.world_size = rank, world_size
        self.cfg, self.hf_checkpoint, self.load = trainer_cfg, hf_checkpoint, load
        self.trainer, self.ref_state, self.group, self.layout = None, None, None, None

    def rendezvous(self):
        return node_rendezvous()

    def start(self, master_addr, master_port):
        """Join the trainer group (collective over all ranks) and build the Trainer."""
        from trainer.distributed import init_distributed
        from trainer.trainer import Trainer

        trainer_cfg, hf_checkpoint, load = self.cfg, self.hf_checkpoint, self.load
        init_distributed(self.rank, self.world_size, master_addr, master_port,
                         trainer_cfg.tensor_model_parallel_size, trainer_cfg.pipeline_model_parallel_size)
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
        """`num_steps` optimizer steps over this rank's `samples`; metrics averaged over them."""
        start = time.perf_counter()
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
        totals["perf/train_time"] = time.perf_counter() - start
        return totals

    def weight_layout(self, buffer_size):
        return weight_sync.bucket_layout(self.trainer.named_hf_weights(), buffer_size)

    def join_weight_sync(self, master_addr, master_port, world_size, layout, backend="gloo"):
        self.layout, self.sync_device = layout, weight_sync.device_for(backend)
        self.group = weight_sync.make_group(master_addr, master_port, 0, world_size, backend)
        return 0

    def send_weights(self):
        """Collective over the trainer group (TP gather); rank 0 broadcasts to the workers."""
        named = [(k, v.detach().cpu()) for k, v in self.trainer.named_hf_weights()]
        if self.rank != 0:
            return None
        start = time.perf_counter()
        sent = weight_sync.send(self.group, self.layout, named, self.sync_device)
        return self._sent_report(named, sent, start)

    def _sent_report(self, named, sent, start):
        """Bytes and seconds of a push, and the checksums the rollout side must match."""
        return {"bytes": sent, "seconds": time.perf_counter() - start,
                "mtp_checksum": weight_sync.checksum(_mtp_only(named, self.trainer.model_cfg, True)),
                "trunk_checksum": weight_sync.checksum(_mtp_only(named, self.trainer.model_cfg, False))}

    # --vllm-weight-transfer nccl: rank 0 broadcasts into vLLM's workers (trainer/vllm_transfer.py)
    def join_vllm_transfer(self, master_addr, master_port, world_size):
        if self.rank == 0:
            from trainer.vllm_transfer import VLLMTransferSender

            self.vllm_sender = VLLMTransferSender(master_addr, master_port, world_size)
        return self.rank

    def vllm_transfer_infos(self, plan):
        """Collective (TP gather); rank 0 returns the rounds' names, dtypes and shapes."""
        from trainer.vllm_transfer import VLLMTransferSender

        named = [(k, v.detach()) for k, v in self.trainer.named_hf_weights()]
        return VLLMTransferSender.infos(named, plan) if self.rank == 0 else None

    def send_vllm_transfer(self, plan):
        """Collective (TP gather); rank 0 broadcasts every round while the engines receive them."""
        named = [(k, v.detach()) for k, v in self.trainer.named_hf_weights()]
        if self.rank != 0:
            return None
        start = time.perf_counter()
        sent = self.vllm_sender.send(named, plan)
        return self._sent_report([(k, v.cpu()) for k, v in named], sent, start)

    def digests(self):
        named = [(k, v.detach().cpu()) for k, v in self.trainer.named_hf_weights()]
        return weight_sync.digests(named) if self.rank == 0 else None

    def save(self, path):
        self.trainer.save(path)
        return path


def _mtp_only(named, model_cfg, mtp):
    from vime.models.families import is_draft_name

    return [(k, v) for k, v in named if is_draft_name(k, model_cfg.num_hidden_layers) == mtp]


TrainerActor = ray.remote(TrainerActorImpl)
