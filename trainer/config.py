"""`TrainerConfig`: the trainer's slice of the config tree (vime/config.py is the schema).

Each field names the tree key it is read from (`train.lr`, `mtp.loss_scaling_factor`, ...), and
its default *is* that key's default, so the trainer, the YAML and `--help` cannot disagree.
`TrainerConfig.from_tree(cfg)` builds it from a whole `Config`.
"""
import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Optional

from vime.config import Config
from vime.parallel_layout import ParallelLayout


def tree_field(key):
    """A field read from the config tree's `section.field` `key`, with that field's default."""
    section, name = key.split(".")
    default = getattr(getattr(Config(), section), name)
    if isinstance(default, (dict, list)):  # a mutable default is made fresh per instance
        return dataclasses.field(default_factory=lambda: getattr(getattr(Config(), section), name),
                                 metadata={"tree_key": key})
    return dataclasses.field(default=default, metadata={"tree_key": key})


@dataclass
class TrainerConfig:
    """Optimisation, policy-loss, MTP-training and parallelism settings of one trainer."""

    lr: float = tree_field("train.lr")
    weight_decay: float = tree_field("train.weight_decay")
    adam_eps: float = tree_field("train.adam_eps")
    clip_grad: float = tree_field("train.clip_grad")
    eps_clip: float = tree_field("train.eps_clip")
    eps_clip_high: Optional[float] = tree_field("train.eps_clip_high")  # None: same as eps_clip
    use_kl_loss: bool = tree_field("train.use_kl_loss")
    kl_loss_coef: float = tree_field("train.kl_loss_coef")
    kl_estimator: str = tree_field("train.kl_loss_type")  # trainer/losses.py KL_ESTIMATORS
    advantage_estimator: str = tree_field("train.advantage_estimator")  # gspo: a sequence-level ratio
    temperature: float = tree_field("rollout.rollout_temperature")  # log-probs are taken at it
    enable_mtp_training: bool = tree_field("mtp.enable_training")
    mtp_num_layers: Optional[int] = tree_field("mtp.num_layers")  # None: as many as the HF checkpoint has
    mtp_train_depths: Optional[int] = tree_field("mtp.train_depths")  # None: one per MTP layer
    mtp_reuse_attention: str = tree_field("mtp.reuse_attention")  # mtp/reuse.py REUSE_ATTENTION
    mtp_loss_scaling_factor: float = tree_field("mtp.loss_scaling_factor")
    mtp_detach_trunk: bool = tree_field("mtp.detach_trunk")
    tensor_model_parallel_size: int = tree_field("train.tensor_model_parallel_size")
    pipeline_model_parallel_size: int = tree_field("train.pipeline_model_parallel_size")
    decoder_first_pipeline_num_layers: Optional[int] = tree_field("train.decoder_first_pipeline_num_layers")
    decoder_last_pipeline_num_layers: Optional[int] = tree_field("train.decoder_last_pipeline_num_layers")
    data_parallel_size: int = tree_field("train.data_parallel_size")
    expert_model_parallel_size: int = tree_field("train.expert_model_parallel_size")
    expert_tensor_parallel_size: Optional[int] = tree_field("train.expert_tensor_parallel_size")  # None: TP's
    micro_batch_size: int = tree_field("train.micro_batch_size")  # 0: the whole local batch at once
    global_batch_size: int = tree_field("train.global_batch_size")  # informational: train_step gets the step
    seed: int = tree_field("train.seed")
    use_tis: bool = tree_field("train.use_tis")  # weight the loss by min(pi_old / pi_rollout, tis_clip)
    tis_clip: float = tree_field("train.tis_clip")
    use_rollout_routing_replay: bool = tree_field("train.use_rollout_routing_replay")  # MoE: replay rollout routes
    moe_router_bias_update_rate: float = tree_field("train.moe_router_bias_update_rate")  # MoE expert-bias step
    enable_draft_training: bool = tree_field("draft.enable_training")  # the external draft of speculative_config
    # how the trained draft (MTP layers or external) steps; None: the kind's own default (vime/models/draft_kinds.py)
    draft_lr: Optional[float] = tree_field("draft.lr")
    draft_lr_warmup_iters: int = tree_field("draft.lr_warmup_iters")  # steps its lr rises from 0 over
    draft_steps_per_rollout: Optional[int] = tree_field("draft.steps_per_rollout")  # > 1: draft-only steps
    draft_replay_batches: Optional[int] = tree_field("draft.replay_batches")  # earlier batches they also cycle over
    draft_loss_type: str = tree_field("draft.loss_type")  # mtp/loss.py MTP_LOSSES
    draft_distill_topk: int = tree_field("draft.distill_topk")  # soft_ce / tv: the target's top-k (0: all)
    draft_clip_grad: Optional[float] = tree_field("draft.clip_grad")  # None: same as clip_grad
    draft_loss_scaling_factor: float = tree_field("draft.loss_scaling_factor")  # an external draft's
    draft_ttt_steps: Optional[int] = tree_field("draft.ttt_steps")  # None: num_speculative_tokens
    # the weights of a kind's loss terms (its descriptor's loss_weights); None: the kind's own
    draft_ce_weight: Optional[float] = tree_field("draft.ce_weight")
    draft_l1_weight: Optional[float] = tree_field("draft.l1_weight")
    draft_confidence_weight: Optional[float] = tree_field("draft.confidence_weight")
    # the rollout's speculative config (vime.spec_config.SpecConfig, or None): an external draft is its `model`
    speculative_config: Any = tree_field("rollout.vllm_speculative_config")
    bf16: bool = tree_field("model.bf16")  # bf16 compute, fp32 master weights (megatron's optimizer)
    offload_optimizer_state: bool = tree_field("train.offload_optimizer_state")  # trainer/offload.py, between steps
    offload_train: bool = tree_field("train.offload_train")  # the weights too
    # megatron's DDP and optimizer (trainer/optimizer.py)
    use_distributed_optimizer: bool = tree_field("train.use_distributed_optimizer")
    overlap_grad_reduce: bool = tree_field("train.overlap_grad_reduce")
    optimizer_cpu_offload: bool = tree_field("train.optimizer_cpu_offload")
    optimizer_offload_fraction: float = tree_field("train.optimizer_offload_fraction")
    overlap_cpu_optimizer_d2h_h2d: bool = tree_field("train.overlap_cpu_optimizer_d2h_h2d")
    use_precision_aware_optimizer: bool = tree_field("train.use_precision_aware_optimizer")
    main_grads_dtype: str = tree_field("train.main_grads_dtype")
    exp_avg_dtype: str = tree_field("train.exp_avg_dtype")
    exp_avg_sq_dtype: str = tree_field("train.exp_avg_sq_dtype")
    # megatron's activation recompute and the parallel dimensions that split a sequence (trainer/model.py)
    recompute_granularity: Optional[str] = tree_field("train.recompute_granularity")
    recompute_method: Optional[str] = tree_field("train.recompute_method")
    recompute_num_layers: Optional[int] = tree_field("train.recompute_num_layers")
    sequence_parallel: bool = tree_field("train.sequence_parallel")
    context_parallel_size: int = tree_field("train.context_parallel_size")

    @classmethod
    def from_tree(cls, cfg):
        """The trainer's slice of a whole `Config` (vime/config.py), the speculative config typed."""
        values = {}
        for f in fields(cls):
            section, name = f.metadata["tree_key"].split(".")
            values[f.name] = getattr(getattr(cfg, section), name)
        values["speculative_config"] = _typed_spec(values["speculative_config"], cfg.rollout.backend)
        return cls(**values)

    @property
    def layout(self):
        """The trainer's parallel layout (vime/parallel_layout.py)."""
        return ParallelLayout.of(self)

    @property
    def effective_draft_clip_grad(self):
        return self.clip_grad if self.draft_clip_grad is None else self.draft_clip_grad

    @property
    def draft_loss_weights(self):
        """{term: weight} of the loss terms given (the others keep the kind's defaults)."""
        given = (("ce", self.draft_ce_weight), ("l1", self.draft_l1_weight),
                 ("confidence", self.draft_confidence_weight))
        return {term: weight for term, weight in given if weight is not None}

    @property
    def effective_eps_clip_high(self):
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


def _typed_spec(value, backend):
    """The speculative config as the `SpecConfig` the config load made of it (None: no speculation);
    a tree built in code may still hold the JSON or mapping, parsed here the one time."""
    from vime.spec_config import as_spec_config

    return as_spec_config(value, backend)
