"""What one trainer rank keeps of each token for the backward pass, by layer (pure: arithmetic on a ModelConfig).

The accounting is Korthikanti et al.'s ("Reducing Activation Recomputation in Large Transformer Models",
2022), the one Megatron's documentation uses, extended to the layers vime trains (RMSNorm, SwiGLU MLPs, GQA
or multi-latent attention, MoE with shared experts): a layer keeps the inputs of its matrix products, of
its norms and of its activation functions, in the compute dtype, each divided by the ranks that split it:

- TP splits what lies inside attention and the MLPs (heads, the MLP width); under sequence parallelism it
  also splits the sequence outside them (the norms' inputs, the residual stream), otherwise every TP rank
  keeps all of it;
- a routed expert keeps, for each token it receives, its input and its SwiGLU's (split over ETP); with
  balanced routing the EP ranks of an expert shard share the group's (token, expert) pairs evenly, and the
  ETP ranks of a shard each receive all of that shard's;
- attention: Transformer Engine's fused attention (`te`) keeps q, k, v, its output and the softmax's
  log-sum-exp (4 bytes per head); megatron's local attention (`local`, the CPU layers) keeps the softmax
  probabilities too, one fp32 value per head and key position: that term grows with the sequence.

Recompute (megatron's): `full` keeps only the input of each recomputed chunk of layers (uniform: chunks of
`num_layers`; block: the first `num_layers` layers of a stage one by one, the rest in full) and rebuilds one
chunk at a time in the backward pass; `selective` rebuilds attention's core, so the softmax terms go.

The counts are per token of a micro-batch on this rank's pipeline stage (its TP group's tokens, after
context parallelism split the sequences: CP ranks hold different tokens). Not counted: the fp32 logits of
the output layer, which the memory plan counts apart (vime's trainer gathers the whole vocabulary on every
TP rank).
"""
from dataclasses import dataclass
from typing import Optional

FP32 = 4


@dataclass(frozen=True)
class Split:
    """How a rank's share of a layer's activations is cut: TP, whether the sequence is split over TP, ETP."""

    tp: int = 1
    sp: bool = False
    etp: int = 1

    @property
    def outside(self):
        """Ranks the activations outside attention and the MLPs (norm inputs, the residual stream) split over."""
        return self.tp if self.sp else 1


@dataclass(frozen=True)
class RecomputePlan:
    """megatron's --recompute-granularity / -method / -num-layers (None: keep everything)."""

    granularity: Optional[str] = None  # full | selective
    method: Optional[str] = None  # uniform | block (full only)
    num_layers: Optional[int] = None

    @classmethod
    def of(cls, cfg):
        """The recompute of a config with the trainer's field names (TrainSection, TrainerConfig)."""
        return cls(cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers)

    def transformer_config(self):
        """megatron-core TransformerConfig's fields of it."""
        return dict(recompute_granularity=self.granularity, recompute_method=self.method,
                    recompute_num_layers=self.num_layers)


def recompute_problem(stage_layer_counts, recompute):
    """Why megatron-core cannot recompute as `recompute` says over pipeline stages of `stage_layer_counts` decoder
    layers (None: it can): uniform recompute walks each stage in chunks of --recompute-num-layers, and
    megatron-core 0.16 indexes past the stage's last layer when a chunk runs over it."""
    n = recompute.num_layers
    if recompute.granularity != "full" or recompute.method != "uniform":
        return None
    uneven = [c for c in stage_layer_counts if c % n]
    return None if not uneven else (
        f"--recompute-num-layers {n} with --recompute-method uniform: megatron-core recomputes each pipeline stage's "
        f"decoder layers in chunks of {n}, and a stage of {uneven[0]} layers does not split into them; choose a "
        f"divisor of {uneven[0]} (or --recompute-method block)")


def attention_elements(cfg, split, spec, context):
    """Elements per token that attention keeps (its norm's input and output included), on one rank."""
    h, t, out = cfg.hidden_size, split.tp, split.outside
    kept = 2 * h / out  # the norm's input and the first projection's input (its output)
    if cfg.mla is None:
        heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, k, v = heads * d, kv * d, kv * d
        core_out = heads * d
    else:
        mla, heads = cfg.mla, cfg.num_attention_heads
        latent = (mla.q_lora_rank or 0) + mla.kv_lora_rank
        # the down-projections' outputs and their norms' outputs (the up-projections' inputs), whole on every rank
        kept += 2 * latent + mla.qk_rope_head_dim
        q = k = heads * mla.qk_head_dim
        v = heads * mla.v_head_dim
        core_out = heads * mla.v_head_dim
    kept += (q + k + v) / t + core_out / t  # the core's inputs; its output, the output projection's input
    return kept, heads / t  # (elements in the compute dtype, fp32 values per key position per head set)


def attention_bytes(cfg, split, spec, context, dtype_bytes, keep_core=True):
    """Bytes per token of one attention block; `context`: the key positions a query sees (local spec);
    `keep_core` False: selective recompute rebuilds the core's softmax."""
    elements, heads = attention_elements(cfg, split, spec, context)
    core = heads * FP32 if spec == "te" else heads * context * FP32  # log-sum-exp, or the probabilities
    return elements * dtype_bytes + (core if keep_core else 0)


def mlp_elements(cfg, split, layer):
    """Elements per token the MLP block of decoder layer `layer` keeps (its norm included)."""
    h, t, out = cfg.hidden_size, split.tp, split.outside
    kept = 2 * h / out  # the norm's input and the MLP's input
    moe = cfg.moe
    if moe is None or not moe.is_moe_layer(layer):
        return kept + 3 * cfg.intermediate_size / t  # the SwiGLU's input (gate, up) and the down-projection's
    k, width, etp = moe.num_experts_per_tok, moe.moe_intermediate_size, split.etp
    # per token a rank routes (1 / `out` of the group's each), k pairs reach ETP ranks each: their inputs,
    # SwiGLU's input and the down-projection's (split over ETP); the routed outputs are combined back
    kept += k * (etp * h + 3 * width) / out + k * h / out
    kept += moe.n_shared_experts * 3 * width / t
    return kept


def router_bytes(cfg, split, layer):
    """Bytes per token a MoE router keeps: its fp32 scores (and the chosen experts' weights)."""
    moe = cfg.moe
    if moe is None or not moe.is_moe_layer(layer):
        return 0
    return (moe.n_routed_experts + moe.num_experts_per_tok) * FP32 / split.outside


def layer_bytes(cfg, layer, split, spec, context, dtype_bytes, keep_core=True):
    """Bytes per token decoder layer `layer` keeps for its backward pass on one rank."""
    return (attention_bytes(cfg, split, spec, context, dtype_bytes, keep_core)
            + mlp_elements(cfg, split, layer) * dtype_bytes + router_bytes(cfg, split, layer))


def layer_input_bytes(cfg, split, dtype_bytes):
    """Bytes per token of a layer's input (the residual stream): what full recompute keeps of a chunk."""
    return cfg.hidden_size / split.outside * dtype_bytes


@dataclass(frozen=True)
class StageActivations:
    """Bytes per token of one micro-batch that a pipeline stage's rank keeps: while it waits for its backward
    pass (`kept`), and on top of that at the backward's peak (`rebuilt`: one recomputed chunk's layers)."""

    kept: float
    rebuilt: float

    @property
    def peak(self):
        return self.kept + self.rebuilt


def stage_activations(cfg, layers, split, spec, context, dtype_bytes, recompute=RecomputePlan(), mtp_layers=0):
    """StageActivations of a stage holding decoder layers `layers` (and `mtp_layers` MTP layers, each a decoder
    layer of the model's last kind plus its input projection, never recomputed: the trainer runs them itself)."""
    layers = list(layers)
    keep_core = recompute.granularity != "selective"
    full = [layer_bytes(cfg, i, split, spec, context, dtype_bytes, keep_core) for i in layers]
    mtp = mtp_layers * (layer_bytes(cfg, cfg.num_hidden_layers - 1, split, spec, context, dtype_bytes)
                        + 2 * cfg.hidden_size * dtype_bytes / split.outside)
    if recompute.granularity != "full" or not layers:
        return StageActivations(sum(full) + mtp, 0.0)
    n, one_input = recompute.num_layers, layer_input_bytes(cfg, split, dtype_bytes)
    if recompute.method == "block":
        recomputed = min(n, len(layers))
        kept = recomputed * one_input + sum(full[recomputed:])
        return StageActivations(kept + mtp, max(full[:recomputed], default=0.0))
    chunks = [full[i:i + n] for i in range(0, len(full), n)]
    return StageActivations(len(chunks) * one_input + mtp, max(sum(c) for c in chunks))
