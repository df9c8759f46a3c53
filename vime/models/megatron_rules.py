"""What vime's megatron-core trainer can build, and over which parallel layouts (pure: no megatron import).

The trainer checks a model and its layout here before it builds anything (orchestration/preflight.py,
trainer/model.py, the converters), and the memory plan (memory_plan.py) lists only the layouts these
rules accept, so the plan never proposes a layout the trainer would refuse. Every rule raises a one-line
`UserError` naming the flag and what to choose. The layout rules are megatron-core's:

- TP divides the attention heads, the key/value heads, the vocabulary and the widths it splits;
- the routed experts go over EP x ETP of each pipeline stage's TP x DP ranks (megatron's expert
  groups), EP dividing the experts and ETP each expert's width;
- PP stages hold whole decoder layers, evenly, or with the first and last stage's counts given
  (slime's `--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`, megatron-core's
  `num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage`) and the middle stages
  splitting the rest evenly.
"""
from dataclasses import dataclass
from typing import Optional

from vime.errors import require


def check_trainable(model_cfg):
    """One line for a MoE / MLA variant the engine runs but megatron-core's layers cannot express."""
    moe, mla, yarn = model_cfg.moe, model_cfg.mla, model_cfg.rope_yarn
    what = f"the trainer (megatron-core) cannot train this {model_cfg.model_family.architectures[0]} checkpoint"
    if moe is not None:
        require(moe.norm_topk_prob and moe.num_experts_per_tok > 1,
                f"{what}: its router must normalise the top-k weights (norm_topk_prob true, "
                f"num_experts_per_tok > 1; got {moe.norm_topk_prob}, {moe.num_experts_per_tok})")
        require(moe.first_k_dense_replace < model_cfg.num_hidden_layers,
                f"{what}: first_k_dense_replace {moe.first_k_dense_replace} leaves no MoE layer, but the MTP "
                "layers are built like the last decoder layer")
    if mla is not None:
        require(mla.rope_interleave, f"{what}: megatron's MLA rotates interleaved rope channels (rope_interleave "
                "true, as DeepSeek-V3 stores them)")
    if yarn is not None:
        require(mla is not None, f"{what}: megatron applies YaRN only with multi-latent attention")
        require(yarn.attention_factor is None and yarn.truncate,
                f"{what}: megatron's YaRN derives the attention factor from mscale/mscale_all_dim and rounds the "
                "ramp ends; drop attention_factor and truncate from rope_scaling")


def check_tensor_parallel(model_cfg, tp):
    """One-line errors for a TP size that does not divide the heads / vocabulary / MLP, or TP over experts."""
    # megatron shards MoE layers over TP only with sequence parallelism, which its local
    # (non-Transformer-Engine) norm does not implement
    require(tp == 1 or model_cfg.moe is None, f"--tensor-model-parallel-size {tp}: mixture-of-experts models "
            f"({model_cfg.model_family.architectures[0]}) train at --tensor-model-parallel-size 1; scale out "
            "with --data-parallel-size")
    for what, n in (("attention heads", model_cfg.num_attention_heads),
                    ("key/value heads", model_cfg.num_key_value_heads),
                    ("vocabulary size", model_cfg.vocab_size),
                    ("hidden size", model_cfg.hidden_size),  # the MTP layers' eh_proj splits it
                    ("MLP width (intermediate_size)", model_cfg.intermediate_size)):
        require(n % tp == 0, f"--tensor-model-parallel-size {tp} does not divide the model's "
                f"{n} {what}; choose a divisor of {n}")


@dataclass(frozen=True)
class Layout:
    """A trainer layout: TP x PP x DP ranks; the routed experts over EP x ETP of each pipeline stage's
    TP x DP ranks; the first and last pipeline stages' decoder-layer counts (None: an even split)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None

    @property
    def world(self):
        return self.tp * self.pp * self.dp

    @property
    def expert_dp(self):
        """Ranks of a pipeline stage that hold the same routed experts (megatron's expert data parallelism)."""
        return self.tp * self.dp // (self.ep * self.etp)


def check_expert_parallel(model_cfg, layout):
    """One-line errors for EP / ETP that a model's experts or a stage's ranks cannot take."""
    ep, etp, moe = layout.ep, layout.etp, model_cfg.moe
    arch = model_cfg.model_family.architectures[0]
    if moe is None:
        require(ep == 1, f"--expert-model-parallel-size {ep}: {arch} is a dense model (no routed experts); "
                "leave it at 1")
        require(etp == 1, f"--expert-tensor-parallel-size {etp}: {arch} is a dense model (no routed experts); "
                "leave it at 1")
        return
    require(moe.n_routed_experts % ep == 0, f"--expert-model-parallel-size {ep} does not divide the model's "
            f"{moe.n_routed_experts} routed experts (n_routed_experts); choose a divisor of {moe.n_routed_experts}")
    require(moe.moe_intermediate_size % etp == 0, f"--expert-tensor-parallel-size {etp} does not divide the "
            f"experts' width {moe.moe_intermediate_size} (moe_intermediate_size); choose a divisor of it")
    stage_ranks = layout.tp * layout.dp
    require(stage_ranks % (ep * etp) == 0, f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size "
            f"{etp} = {ep * etp} must divide the {stage_ranks} ranks of a pipeline stage (TP {layout.tp} x DP "
            f"{layout.dp}): megatron puts a stage's expert groups inside its ranks")


def check_pipeline_depth(num_layers, pp):
    """One line for more pipeline stages than decoder layers."""
    require(pp <= num_layers, f"--pipeline-model-parallel-size {pp} is larger than the model's {num_layers} "
            "decoder layers (num_hidden_layers): every stage holds at least one")


def stage_layer_counts(num_layers, layout):
    """Decoder layers on each pipeline stage, first to last; one-line errors for a split megatron refuses."""
    pp, first, last = layout.pp, layout.first_stage_layers, layout.last_stage_layers
    check_pipeline_depth(num_layers, pp)
    if pp == 1:
        require(first is None and last is None, "--decoder-first-pipeline-num-layers / "
                "--decoder-last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
        return [num_layers]
    if first is None and last is None:
        require(num_layers % pp == 0, f"the model's {num_layers} decoder layers do not split evenly over "
                f"--pipeline-model-parallel-size {pp} stages; set --decoder-first-pipeline-num-layers and/or "
                "--decoder-last-pipeline-num-layers (the other stages split the rest evenly)")
        return [num_layers // pp] * pp
    ends = [n for n in (first, last) if n is not None]
    require(all(n >= 1 for n in ends), "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers "
            "must be >= 1")
    others = pp - len(ends)
    rest = num_layers - sum(ends)
    require(rest >= others and (others == 0 and rest == 0 or others > 0 and rest % others == 0),
            f"--decoder-first-pipeline-num-layers {first} and --decoder-last-pipeline-num-layers {last} leave "
            f"{rest} of the {num_layers} decoder layers for {others} other stages: they must split evenly, "
            "at least one layer each")
    middle = [rest // others] * others if others else []
    return ([first] if first is not None else []) + middle + ([last] if last is not None else [])


def check_layout(model_cfg, layout):
    """Every rule above for `layout` of `model_cfg`; returns the decoder layers of each pipeline stage."""
    check_tensor_parallel(model_cfg, layout.tp)
    check_expert_parallel(model_cfg, layout)
    return stage_layer_counts(model_cfg.num_hidden_layers, layout)
