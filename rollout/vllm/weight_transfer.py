"""--vllm-weight-transfer nccl: vLLM's own weight transfer engine (`weight_transfer_config` backend
"nccl"), both of its ends. GPU only: NCCL moves CUDA tensors (the reload path covers CPU).

- `NcclReceiver`, in the rollout worker: the engine's vLLM worker joins trainer rank 0's NCCL
  group at its rank offset (`init_weight_transfer_engine`; one vLLM worker per engine) and receives
  an update as rounds - the target, then the drafter (`start_draft_weight_update`) - each packed.
- `NcclSendingEnd`, in trainer rank 0 (the receiver's plan names it; trainer/weight_senders.py
  runs it): opens the group as its rank 0 (vLLM's `trainer_init`) and broadcasts the same rounds,
  cut by vime/models/vllm_names.py `update_rounds` from the tensors where the trainer holds them.
"""
import torch

from vime.models.vllm_names import round_info, update_rounds


def update_infos(named, plan):
    """What the engines must be told before a round arrives: [(kind, names / dtypes / shapes)]."""
    return [(kind, round_info(tensors)) for kind, tensors in rounds(named, plan)]


def rounds(named, plan):
    """[(kind, {checkpoint name: tensor})] of (canonical name, tensor) pairs for an engine's `plan`."""
    return update_rounds(dict(named), plan["layout"], plan["num_hidden_layers"], plan["num_mtp_layers"],
                         plan["has_draft"])


class NcclReceiver:
    """One vLLM engine's end of the NCCL group; the header of a push is `update_infos`."""

    def __init__(self, backend, keep_draft=True):
        self.backend, self.keep_draft = backend, keep_draft

    def plan(self):
        return dict(self.backend.weights.plan(self.keep_draft), sending_end=NcclSendingEnd)

    def join(self, rendezvous, rank):
        """Join trainer rank 0's NCCL group through vLLM's weight transfer engine (blocks until it joins)."""
        self.backend.llm.init_weight_transfer_engine({"init_info": {
            "master_address": rendezvous["master_addr"], "master_port": rendezvous["master_port"],
            "rank_offset": rank, "world_size": rendezvous["world_size"], "packed": True}})

    def receive(self, infos, version):
        """Receive one update's rounds as the trainer broadcasts them: the target, then the drafter."""
        llm, weights = self.backend.llm, self.backend.weights
        for kind, info in infos:
            (llm.start_weight_update if kind == "target" else llm.start_draft_weight_update)()
            llm.update_weights({"update_info": info})
            llm.finish_weight_update()
            weights.note_round(kind, {k: tuple(shape) for k, shape in zip(info["names"], info["shapes"])})
        weights.read_back()  # on GPU vLLM keeps every parameter readable: the guard sees what arrived
        self.backend.weights_changed(version)


class NcclSendingEnd:
    """Trainer rank 0's end: the NCCL group with every rollout engine's vLLM worker."""

    def __init__(self, plan, rendezvous):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.plan = plan
        self.group = trainer_init({"master_address": rendezvous["master_addr"],
                                   "master_port": rendezvous["master_port"], "world_size": rendezvous["world_size"]})

    def header(self, named):
        return update_infos(named, self.plan)

    def send(self, named):
        """Broadcast every round packed, as the engines expect it, from the trainer's GPU (the tensors
        are the trainer's CUDA tensors: no host copy). Returns the bytes sent."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        sent = 0
        for _, tensors in rounds(named, self.plan):
            pairs = [(k, v.contiguous()) for k, v in tensors.items()]
            sent += sum(v.numel() * v.element_size() for _, v in pairs)
            packed_nccl_broadcast_producer(iterator=iter(pairs), group=self.group, src=0,
                                           post_iter_func=lambda item: item[1])
        torch.cuda.current_stream().synchronize()
        return sent

    def close(self):
        self.group.destroy()
