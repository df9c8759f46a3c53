"""`TrainerConfig`: the trainer's slice of the config tree (the dataclass is the schema)."""
from dataclasses import dataclass
from typing import Optional


@dataclass
class TrainerConfig:
    """Optimisation, policy-loss, MTP-training and parallelism settings of one trainer."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    mtp_clip_grad: Optional[float] = None  # None: same as clip_grad
    mtp_lr: Optional[float] = None  # None: same as lr (Adam is scale-free: the loss factor barely moves a detached draft)
    eps_clip: float = 0.2
    eps_clip_high: Optional[float] = None  # None: same as eps_clip
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_estimator: str = "k3"  # k1 | k3
    advantage_estimator: str = "grpo"  # gspo switches the loss to a sequence-level ratio
    temperature: float = 1.0  # the rollout temperature: log-probs are taken at it
    enable_mtp_training: bool = False
    mtp_num_layers: Optional[int] = None  # None: as many as the HF checkpoint has
    mtp_loss_scaling_factor: float = 0.2
    mtp_detach_trunk: bool = True
    mtp_loss_type: str = "ce"  # ce | soft_ce | tv (mtp/loss.py MTP_LOSSES)
    mtp_distill_topk: int = 0  # soft_ce / tv: keep the target's top-k (0: the full vocabulary)
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    micro_batch_size: int = 0  # 0: the whole local batch in one micro-batch
    global_batch_size: int = 0  # informational; the batch passed to train_step is the step
    seed: int = 1234

    @property
    def effective_mtp_clip_grad(self):
        return self.clip_grad if self.mtp_clip_grad is None else self.mtp_clip_grad

    @property
    def effective_eps_clip_high(self):
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high
