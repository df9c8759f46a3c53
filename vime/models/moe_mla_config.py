"""The mixture-of-experts, multi-head latent attention and RoPE-scaling keys of an HF config (pure).

GLM-4.5/4.6/4.7 (`Glm4MoeForCausalLM`) and DeepSeek-V3/R1/V3.1 (`DeepseekV3ForCausalLM`)
configs carry these keys; each is either honoured (parsed into `MoEConfig`, `MLAConfig`,
`YarnScaling`, `Llama3Scaling` or a ModelConfig field) or refused with one line naming the file, the key and
what vime supports. Nothing is silently ignored that changes the forward pass; keys that only
concern training schedules or parallel layouts (`aux_loss_alpha`, `seq_aux`, `ep_size`,
`initializer_range`, ...) do not.
"""
from dataclasses import dataclass

from vime.errors import require
from vime.models.rope import Llama3Scaling, YarnScaling


@dataclass(frozen=True)
class MoEConfig:
    """Routed + shared experts and their router (DeepSeek-V3 / GLM-4.5 semantics, moe_routing.py)."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0  # the first k decoder layers keep a dense MLP
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def is_moe_layer(self, index):
        """Decoder layer `index` (MTP layers continue the numbering, so they are MoE) uses experts."""
        return index >= self.first_k_dense_replace


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention: queries through an optional low-rank q, keys/values from a
    per-token latent of `kv_lora_rank` plus one shared rope key of `qk_rope_head_dim`."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = None  # None: a single q_proj
    rope_interleave: bool = True  # DeepSeek's rope channels come in (even, odd) pairs

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self):
        """Values cached per token and layer: the compressed KV and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def expanded_width(self, num_heads):
        """Values per token and layer of a cache holding the expanded per-head K and V."""
        return num_heads * (self.qk_head_dim + self.v_head_dim)


SCORING_FUNCS = ("sigmoid",)
TOPK_METHODS = (None, "noaux_tc")  # sigmoid scores + e_score_correction_bias, group-limited
ACTIVATIONS = ("silu",)


def _int(raw, key, source, lowest=1, default=None):
    value = raw.get(key, default)
    require(isinstance(value, int) and not isinstance(value, bool) and value >= lowest,
            f"{source}: {key!r} must be an integer >= {lowest} (got {value!r}); fix config.json")
    return value


def _bool(raw, key, source, default):
    value = raw.get(key, default)
    value = default if value is None else value
    require(isinstance(value, bool), f"{source}: {key!r} must be true or false (got {value!r}); fix config.json")
    return value


def _positive(raw, key, source, default):
    value = raw.get(key, default)
    value = default if value is None else value
    require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
            f"{source}: {key!r} must be a number > 0 (got {value!r}); fix config.json")
    return float(value)


def check_unsupported(raw, source, arch):
    """One line for a key whose value changes the forward pass in a way vime does not implement."""
    require(raw.get("quantization_config") is None,
            f"{source}: quantised checkpoints (quantization_config, *_scale_inv tensors) are not supported; "
            f"dequantise the {arch} checkpoint to bf16/fp32 first")
    require(raw.get("hidden_act", "silu") in ACTIVATIONS,
            f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported; {arch} uses silu")
    require(raw.get("scoring_func", "sigmoid") in SCORING_FUNCS,
            f"{source}: scoring_func {raw.get('scoring_func')!r} is not supported; vime routes with sigmoid "
            "scores + e_score_correction_bias (DeepSeek-V3 / GLM-4.5)")
    require(raw.get("topk_method") in TOPK_METHODS,
            f"{source}: topk_method {raw.get('topk_method')!r} is not supported; vime implements 'noaux_tc' "
            "(choice on scores + e_score_correction_bias, group-limited)")
    require(raw.get("moe_layer_freq", 1) == 1,
            f"{source}: moe_layer_freq {raw.get('moe_layer_freq')!r} is not supported; every layer from "
            "first_k_dense_replace on is MoE (moe_layer_freq 1)")


def parse_moe(raw, source):
    """MoEConfig of a GLM-4.5 / DeepSeek-V3 config, or a one-line UserError."""
    experts = _int(raw, "n_routed_experts", source)
    top_k = _int(raw, "num_experts_per_tok", source)
    n_group = _int(raw, "n_group", source, default=1) if raw.get("n_group") is not None else 1
    topk_group = _int(raw, "topk_group", source, default=1) if raw.get("topk_group") is not None else 1
    require(experts % n_group == 0, f"{source}: n_routed_experts {experts} is not a multiple of n_group {n_group}; "
            "fix config.json")
    require(topk_group <= n_group, f"{source}: topk_group {topk_group} > n_group {n_group}; fix config.json")
    require(n_group == 1 or experts // n_group >= 2,
            f"{source}: n_group {n_group} leaves fewer than 2 experts per group (groups rank by their top-2 "
            "scores); fix config.json")
    require(top_k <= topk_group * (experts // n_group),
            f"{source}: num_experts_per_tok {top_k} exceeds the {topk_group * (experts // n_group)} experts of "
            f"topk_group {topk_group} groups; fix config.json")
    return MoEConfig(
        n_routed_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=_int(raw, "moe_intermediate_size", source),
        n_shared_experts=_int(raw, "n_shared_experts", source, lowest=0, default=0)
        if raw.get("n_shared_experts") is not None else 0,
        first_k_dense_replace=_int(raw, "first_k_dense_replace", source, lowest=0, default=0)
        if raw.get("first_k_dense_replace") is not None else 0,
        n_group=n_group, topk_group=topk_group,
        norm_topk_prob=_bool(raw, "norm_topk_prob", source, True),
        routed_scaling_factor=_positive(raw, "routed_scaling_factor", source, 1.0))


def parse_mla(raw, source):
    """MLAConfig of a DeepSeek-V3 config, or a one-line UserError."""
    require(not raw.get("attention_bias", False),
            f"{source}: attention_bias true is not supported for multi-head latent attention "
            "(DeepSeek-V3/R1 checkpoints have none); set it to false")
    q_lora = raw.get("q_lora_rank")
    mla = MLAConfig(
        kv_lora_rank=_int(raw, "kv_lora_rank", source), qk_nope_head_dim=_int(raw, "qk_nope_head_dim", source),
        qk_rope_head_dim=_int(raw, "qk_rope_head_dim", source), v_head_dim=_int(raw, "v_head_dim", source),
        q_lora_rank=None if q_lora is None else _int(raw, "q_lora_rank", source),
        rope_interleave=_bool(raw, "rope_interleave", source, True))
    require(mla.qk_rope_head_dim % 2 == 0,
            f"{source}: qk_rope_head_dim {mla.qk_rope_head_dim} must be even (rotary pairs); fix config.json")
    return mla


def rope_block(raw):
    """The RoPE block of a config: transformers 5 writes `rope_parameters`, published checkpoints
    `rope_scaling` (with `type` for `rope_type`) next to a top-level `rope_theta`."""
    block = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if "type" in block and "rope_type" not in block:
        block["rope_type"] = block.pop("type")
    return block


def parse_rope_scaling(raw, source, family):
    """{"rope_yarn": YarnScaling} or {"rope_llama3": Llama3Scaling} of the config's RoPE block ({} for plain
    RoPE); a rope type the family's `rope_types` does not list is refused in one line."""
    block = rope_block(raw)
    rope_type = block.get("rope_type", "default")
    require(rope_type in family.rope_types,
            f"{source}: rope type {rope_type!r} is not supported for {family.architectures[0]}; vime implements "
            f"{', '.join(family.rope_types)} for it")
    return {} if rope_type == "default" else {ROPE_SCALINGS[rope_type][0]: ROPE_SCALINGS[rope_type][1](raw, source)}


def _original_context(raw, block, source):
    original = block.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    return _int({"original_max_position_embeddings": original}, "original_max_position_embeddings", source)


def parse_llama3(raw, source):
    """Llama3Scaling of a Llama 3.1+ config's `rope_type: llama3` block (every key required, as transformers
    requires them)."""
    block = rope_block(raw)
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if block.get(k) is None]
    require(not missing, f"{source}: rope type 'llama3' needs {', '.join(missing)} in rope_scaling; fix config.json")
    scaling = Llama3Scaling(
        factor=_positive(block, "factor", source, None), low_freq_factor=_positive(block, "low_freq_factor", source, None),
        high_freq_factor=_positive(block, "high_freq_factor", source, None),
        original_max_position_embeddings=_original_context(raw, block, source))
    require(scaling.high_freq_factor > scaling.low_freq_factor,
            f"{source}: rope_scaling high_freq_factor {scaling.high_freq_factor} must exceed low_freq_factor "
            f"{scaling.low_freq_factor}; fix config.json")
    return scaling


def parse_yarn(raw, source):
    """YarnScaling of a config whose RoPE block has `rope_type: yarn`."""
    block = rope_block(raw)
    return YarnScaling(
        factor=_positive(block, "factor", source, None),
        original_max_position_embeddings=_original_context(raw, block, source),
        beta_fast=_positive(block, "beta_fast", source, 32.0), beta_slow=_positive(block, "beta_slow", source, 1.0),
        mscale=float(block.get("mscale") or 0.0), mscale_all_dim=float(block.get("mscale_all_dim") or 0.0),
        attention_factor=block.get("attention_factor"), truncate=_bool(block, "truncate", source, True))


# rope type -> (the ModelConfig field it fills, its parser)
ROPE_SCALINGS = {"yarn": ("rope_yarn", parse_yarn), "llama3": ("rope_llama3", parse_llama3)}


def parse_partial_rotary(raw, source, head_dim):
    """The share of each head's channels that RoPE rotates (GLM-4.5: 0.5); the rest pass unrotated."""
    block = rope_block(raw)
    factor = raw.get("partial_rotary_factor", block.get("partial_rotary_factor", 1.0))
    factor = _positive({"partial_rotary_factor": factor}, "partial_rotary_factor", source, 1.0)
    require(factor <= 1.0 and int(head_dim * factor) % 2 == 0 and int(head_dim * factor) > 0,
            f"{source}: partial_rotary_factor {factor} must be in (0, 1] and rotate an even number of the "
            f"{head_dim} head channels; fix config.json")
    return factor


def parse_glm_attention(raw, source):
    """(attention_bias, use_qk_norm) of a GLM-4.5 config: q/k/v bias and per-head q/k RMSNorm."""
    return _bool(raw, "attention_bias", source, False), _bool(raw, "use_qk_norm", source, False)
