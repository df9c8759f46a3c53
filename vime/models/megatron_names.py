"""Declarative HF-canonical <-> megatron-core name maps for every family + MTP (pure torch).

Both directions work on full (TP-unsharded) tensors. The same tables drive the
HF <-> torch_dist converter and `Trainer.named_hf_weights()` (online weight sync).

A family without q/k norm simply has no `q_layernorm`/`k_layernorm` parameters, one with
q/k/v bias has `linear_qkv.bias`: megatron's own parameter list says which entries apply.
Megatron fuses q/k/v into `linear_qkv` (rows per query group: [q heads of the group, k, v])
and gate/up into `linear_fc1` (rows: [gate; up]). MTP layer k lives under
`mtp.layers.{k}` with its decoder layer in the submodule named `MTP_INNER_LAYER`.

Multi-latent attention (DeepSeek-V3) has its own projections (`MLA_LAYER`; its q/kv latent norms
take the `q_layernorm`/`kv_layernorm` slots), and a mixture-of-experts layer (SequentialMLP) its
router, per-expert `local_experts.{e}` MLPs and shared experts (`MOE_LAYER`, `EXPERT`); the
router's `expert_bias` is a buffer, not a parameter (`SYNCED_BUFFERS`), and it is the
checkpoints' `e_score_correction_bias`.
"""
import re

import torch

# megatron-core 0.16.1 names the MTP layer's decoder layer `transformer_layer`; newer releases
# renamed it. This is the one place that knows.
MTP_INNER_LAYER = "transformer_layer"

TOP_LEVEL = {  # megatron name -> canonical HF name
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}

LAYER = {  # decoder-layer suffix, megatron -> HF (1:1 renames)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    # the Transformer-Engine spec (GPU) fuses the pre-norms into the next linear
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
}

MLA_LAYER = {  # multi-latent attention, megatron -> HF (1:1 renames); replaces the GQA attention names
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    # the Transformer-Engine spec fuses the latent norms into the up projections
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
}
ATTENTION_LAYERS = {"gqa": {}, "mla": MLA_LAYER}  # per attention kind: renames that override LAYER

MOE_LAYER = {  # router and shared experts, megatron -> HF (1:1 renames)
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
# buffers that are weights of the checkpoint (synced, converted): the aux-loss-free routing bias
SYNCED_BUFFERS = ("mlp.router.expert_bias",)
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
# a routed expert's parameter anywhere in the model: (its experts module's prefix, expert index, the rest)
_ANY_EXPERT = re.compile(r"^(.+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")

FUSED = {  # decoder-layer suffix, megatron -> (fusion kind, HF parts in order)
    "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                  "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": ("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                "self_attn.v_proj.bias")),
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.shared_experts.linear_fc1.weight": ("gate_up", ("mlp.shared_experts.gate_proj.weight",
                                                          "mlp.shared_experts.up_proj.weight")),
}

MTP_OWN = {  # MTP-layer suffix, megatron -> HF
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}

_DECODER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")


def _expert_targets(suffix, hf_prefix):
    """(fusion kind or None, HF names) of one routed expert's linear, or None for another suffix."""
    m = _EXPERT.match(suffix)
    if not m:
        return None
    expert = f"{hf_prefix}mlp.experts.{m.group(1)}."
    if m.group(2) == "linear_fc1":  # rows [gate; up], as the dense MLP's
        return "gate_up", (expert + "gate_proj.weight", expert + "up_proj.weight")
    return None, (expert + "down_proj.weight",)


def _layer_targets(suffix, hf_prefix, attention):
    """(fusion kind or None, HF names) of a decoder-layer suffix."""
    renames = {**LAYER, **MOE_LAYER, **ATTENTION_LAYERS[attention]}
    if suffix in renames:
        return None, (hf_prefix + renames[suffix],)
    if suffix in FUSED:
        kind, parts = FUSED[suffix]
        return kind, tuple(hf_prefix + p for p in parts)
    expert = _expert_targets(suffix, hf_prefix)
    if expert is not None:
        return expert
    raise KeyError(suffix)


def hf_targets(megatron_name, num_hidden_layers, attention="gqa"):
    """(fusion kind or None, canonical HF names) a megatron parameter (or synced buffer) name maps to;
    `attention`: "gqa" or "mla" (a family's `attention`)."""
    if megatron_name in TOP_LEVEL:
        return None, (TOP_LEVEL[megatron_name],)
    m = _DECODER.match(megatron_name)
    if m:
        return _layer_targets(m.group(2), f"model.layers.{m.group(1)}.", attention)
    m = _MTP.match(megatron_name)
    if m:
        hf_prefix = f"model.layers.{num_hidden_layers + int(m.group(1))}."
        suffix = m.group(2)
        if suffix in MTP_OWN:
            return None, (hf_prefix + MTP_OWN[suffix],)
        inner = MTP_INNER_LAYER + "."
        if suffix.startswith(inner):
            return _layer_targets(suffix[len(inner):], hf_prefix, attention)
    raise KeyError(f"no HF name for megatron parameter {megatron_name}")


def fuse_qkv(q, k, v, num_kv_heads):
    """q [nh*d, H], k/v [nkv*d, H] -> megatron linear_qkv [(nh + 2 nkv) d, H]; biases ([nh*d] ...) alike."""
    trailing = q.shape[1:]
    qg, kg, vg = (t.reshape(num_kv_heads, -1, *trailing) for t in (q, k, v))
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *trailing)


def split_qkv(qkv, num_kv_heads, num_heads, head_dim):
    """Inverse of fuse_qkv."""
    per_group = num_heads // num_kv_heads * head_dim
    trailing = qkv.shape[1:]
    grouped = qkv.reshape(num_kv_heads, per_group + 2 * head_dim, *trailing)
    q, k, v = grouped.split([per_group, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *trailing).contiguous() for t in (q, k, v))


def _fuse(kind, parts, cfg):
    if kind == "qkv":
        return fuse_qkv(*parts, cfg.num_key_value_heads)
    return torch.cat(parts, dim=0)


def _split(kind, tensor, cfg):
    if kind == "qkv":
        return split_qkv(tensor, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim)
    return tuple(t.contiguous() for t in tensor.chunk(2, dim=0))


def attention_kind(cfg):
    """The `attention` argument of hf_targets for a ModelConfig: \"mla\" or \"gqa\"."""
    return "mla" if cfg.mla is not None else "gqa"


def expert_index(megatron_name):
    """(the experts module's prefix, the expert's index) of a routed expert's parameter, else None.
    Under expert parallelism megatron numbers a rank's experts from 0 (its local index)."""
    m = _ANY_EXPERT.match(megatron_name)
    return (m.group(1), int(m.group(2))) if m else None


def with_expert_index(megatron_name, index):
    """A routed expert's parameter name with the expert's index replaced by `index`."""
    m = _ANY_EXPERT.match(megatron_name)
    return f"{m.group(1)}{index}{m.group(3)}"


def is_synced_buffer(megatron_name):
    """True for a megatron buffer that is a checkpoint weight (see SYNCED_BUFFERS)."""
    return megatron_name.endswith(SYNCED_BUFFERS)


def megatron_to_hf(name, tensor, cfg):
    """[(canonical HF name, tensor)] for one full megatron tensor. cfg: a ModelConfig."""
    kind, targets = hf_targets(name, cfg.num_hidden_layers, attention_kind(cfg))
    if kind is None:
        return [(targets[0], tensor)]
    return list(zip(targets, _split(kind, tensor, cfg)))


def hf_to_megatron(name, hf_state, cfg):
    """The full megatron tensor for megatron parameter `name`, built from canonical HF tensors."""
    kind, targets = hf_targets(name, cfg.num_hidden_layers, attention_kind(cfg))
    missing = [t for t in targets if t not in hf_state]
    if missing:
        raise KeyError(f"HF tensor {missing[0]} (for megatron {name}) is missing")
    if kind is None:
        return hf_state[targets[0]]
    return _fuse(kind, [hf_state[t] for t in targets], cfg)
