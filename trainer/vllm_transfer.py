"""--vllm-weight-transfer nccl, the trainer's end: rank 0 broadcasts the policy straight into vLLM's
GPU workers through vLLM's own weight transfer engine (`weight_transfer_config` backend "nccl").

Rank 0 opens the group as its rank 0 (vLLM's `trainer_init`); each rollout engine's worker joins at
its rank offset (rollout/vllm/backend.py `join_transfer`). An update is the rounds of
vime/models/vllm_names.py `update_rounds` in order - the target, then the drafter (vLLM's
`start_draft_weight_update`) - each broadcast packed, while the engines receive the same rounds.
GPU only: NCCL moves CUDA tensors (the reload path covers CPU).
"""
import torch

from vime.models.vllm_names import round_info, update_rounds


class VLLMTransferSender:
    """Trainer rank 0's NCCL group with every rollout engine's vLLM worker."""

    def __init__(self, master_address, master_port, world_size):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init({"master_address": master_address, "master_port": master_port,
                                   "world_size": world_size})

    @staticmethod
    def rounds(named, plan):
        """[(kind, {checkpoint name: tensor})] for the engines' `plan` (rollout/vllm/backend.py)."""
        return update_rounds(dict(named), plan["layout"], plan["num_hidden_layers"], plan["num_mtp_layers"],
                             plan["has_draft"])

    @classmethod
    def infos(cls, named, plan):
        """What the engines must be told before a round arrives: [(kind, names / dtypes / shapes)]."""
        return [(kind, round_info(tensors)) for kind, tensors in cls.rounds(named, plan)]

    def send(self, named, plan):
        """Broadcast every round (packed, as the engines expect it); returns the bytes sent."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        sent = 0
        device = torch.device("cuda", torch.cuda.current_device())
        for _, tensors in self.rounds(named, plan):
            pairs = [(k, v.to(device).contiguous()) for k, v in tensors.items()]
            sent += sum(v.numel() * v.element_size() for _, v in pairs)
            packed_nccl_broadcast_producer(iterator=iter(pairs), group=self.group, src=0,
                                           post_iter_func=lambda item: item[1])
        torch.cuda.current_stream().synchronize()
        return sent

    def close(self):
        self.group.destroy()
