"""The model-family registry (pure: no Ray/Megatron/vLLM imports).

One declarative `ModelFamily` per family says everything that differs between them: the
trunk flavour (q/k/v bias or per-head q/k norm), how its MTP layers are stored (names,
the order of the two halves of the input projection, shared copies), which hidden state
the first MTP layer reads, the HF `architectures`/`model_type`, and the transformers class
that loads the trunk. The engine, the trainer, both converters and weight sync read it;
nothing else names a family.

Inside vime every tensor has a *canonical* HF name: the family's trunk names plus MTP
layer k under `model.layers.{num_hidden_layers + k}.*` (the GLM-4.5 / DeepSeek-V3 names,
`eh_proj` applied to cat(enorm(embedding), hnorm(hidden))). A family's MTP layout maps
those to what its checkpoints store.
"""
import re
from dataclasses import dataclass, field

import torch

from vime.errors import UserError


@dataclass(frozen=True)
class MTPLayout:
    """How one family stores its MTP layers."""

    name: str
    prefix: str  # format string; {n} = num_hidden_layers + k, {k} = MTP index
    renames: dict = field(default_factory=dict)  # canonical suffix -> this layout's suffix
    hidden_first: bool = False  # True: eh_proj columns are [hidden ; embedding]
    shared_copies: tuple = ()  # per-layer copies of shared tensors, dropped on load

    def layer_prefix(self, k, num_hidden_layers):
        return self.prefix.format(n=num_hidden_layers + k, k=k)

    def pattern(self):
        return re.compile("^" + re.escape(self.prefix).replace(r"\{n\}", r"(\d+)").replace(r"\{k\}", r"(\d+)") + r"\.")


GLM_LAYOUT = MTPLayout(
    name="glm",
    prefix="model.layers.{n}",
    shared_copies=("embed_tokens.weight", "shared_head.head.weight"),
)
MIMO_LAYOUT = MTPLayout(
    name="mimo",
    prefix="model.mtp_layers.{k}",
    renames={
        "enorm.weight": "token_layernorm.weight",
        "hnorm.weight": "hidden_layernorm.weight",
        "eh_proj.weight": "input_proj.weight",
        "shared_head.norm.weight": "final_layernorm.weight",
    },
    hidden_first=True,
)
CANONICAL_LAYOUT = GLM_LAYOUT


@dataclass(frozen=True)
class ModelFamily:
    """One model family: trunk flavour, MTP storage and semantics, HF identity."""

    name: str
    architectures: tuple  # HF config.json `architectures` (the first is written)
    model_type: str  # HF config.json `model_type` written (transformers builds the trunk from it)
    hf_trunk_class: str  # transformers class that loads the trunk alone (the tests' reference)
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    mtp_layout: MTPLayout
    # MiMo's drafter (as vLLM runs it) reads the trunk's last hidden state *before* the final
    # norm and sees a zero token embedding at position 0; DeepSeek/GLM-style MTP (and
    # megatron-core's default) reads the final-normed state.
    mtp_reads_pre_norm_hidden: bool = False
    mtp_zero_embedding_at_position_0: bool = False
    head_dim_free: bool = True  # False: head_dim must be hidden_size / num_attention_heads (Qwen2)
    # vLLM's model of this family returns the aux hidden states an external draft reads (its
    # SupportsEagle3 path); vLLM 0.32's MiMo, GLM-4.5 and DeepSeek-V3 models do not, so on the vLLM
    # backend those targets draft with MTP only (the embedded engine computes them for every family)
    vllm_aux_hidden_states: bool = True
    # its checkpoints may carry MTP layers (the MTP tests and recipes run over these families)
    has_mtp: bool = True
    # vLLM 0.32 has an MTP drafter for the architecture (its `method: mtp` picks one by `architectures`); it
    # has none for Llama, so a Llama's fresh MTP layers draft on the embedded engine only
    vllm_mtp_drafter: bool = True
    attention: str = "gqa"  # "gqa": grouped-query attention; "mla": multi-head latent attention (DeepSeek-V3)
    moe: bool = False  # decoder layers from first_k_dense_replace on are mixture-of-experts
    # q/k/v bias and q/k norm are read from the config (`attention_bias`, `use_qk_norm`: GLM-4.5)
    # instead of being fixed for the family
    qkv_from_config: bool = False
    # the config's RoPE types vime implements for the family (rope.py); others are refused in one line
    rope_types: tuple = ("default",)
    # config keys that must be false or absent: parts of the family's architecture vime does not build
    # (Llama's `attention_bias` also biases o_proj, `mlp_bias` the MLP)
    unsupported_true_keys: tuple = ()

    @property
    def layer_tensors(self):
        """Canonical suffixes of one decoder layer's tensors."""
        names = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
        if self.qkv_bias:
            names += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        if self.qk_norm:
            names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        return tuple(names)


FAMILIES = {
    "qwen3": ModelFamily(
        name="qwen3", architectures=("Qwen3ForCausalLM",), model_type="qwen3",
        hf_trunk_class="Qwen3ForCausalLM", qkv_bias=False, qk_norm=True, mtp_layout=GLM_LAYOUT,
    ),
    # A MiMo checkpoint as vLLM serves it with {"method": "mtp"}: the Qwen2 trunk (model_type
    # qwen2, so transformers loads it without remote code) plus `model.mtp_layers.{k}`.
    "mimo": ModelFamily(
        name="mimo", architectures=("MiMoForCausalLM",), model_type="qwen2",
        hf_trunk_class="Qwen2ForCausalLM", qkv_bias=True, qk_norm=False, mtp_layout=MIMO_LAYOUT,
        mtp_reads_pre_norm_hidden=True, mtp_zero_embedding_at_position_0=True, head_dim_free=False,
        vllm_aux_hidden_states=False,
    ),
    # Qwen2 without MTP layers: a target that drafts with an external draft. Its MTP
    # layout is the canonical one only so names resolve; no Qwen2 checkpoint carries MTP layers.
    "qwen2": ModelFamily(
        name="qwen2", architectures=("Qwen2ForCausalLM",), model_type="qwen2",
        hf_trunk_class="Qwen2ForCausalLM", qkv_bias=True, qk_norm=False, mtp_layout=GLM_LAYOUT,
        head_dim_free=False, has_mtp=False,
    ),
    # GLM-4.5/4.6/4.7: GQA with q/k/v bias (and q/k norm where `use_qk_norm`), partial rotary, the
    # first layers dense then MoE with a sigmoid router; MTP layers as `model.layers.{L+k}`
    "glm4_moe": ModelFamily(
        name="glm4_moe", architectures=("Glm4MoeForCausalLM",), model_type="glm4_moe",
        hf_trunk_class="Glm4MoeForCausalLM", qkv_bias=True, qk_norm=False, mtp_layout=GLM_LAYOUT,
        moe=True, qkv_from_config=True, vllm_aux_hidden_states=False, rope_types=("default", "yarn"),
    ),
    # DeepSeek-V3/R1/V3.1: multi-head latent attention with YaRN, the same MoE as GLM-4.5
    "deepseek_v3": ModelFamily(
        name="deepseek_v3", architectures=("DeepseekV3ForCausalLM",), model_type="deepseek_v3",
        hf_trunk_class="DeepseekV3ForCausalLM", qkv_bias=False, qk_norm=False, mtp_layout=GLM_LAYOUT,
        attention="mla", moe=True, vllm_aux_hidden_states=False, rope_types=("default", "yarn"),
    ),
    # Llama 2/3.x, SmolLM2, TinyLlama and their fine-tunes: GQA without q/k/v bias or q/k norm, a free
    # head_dim, tied or untied embeddings, Llama 3.1's frequency scaling. Published checkpoints carry no
    # MTP layers; `--enable-mtp-training --mtp-num-layers N` adds fresh ones (docs/drafts.md), stored
    # as the canonical `model.layers.{L+k}`.
    "llama": ModelFamily(
        name="llama", architectures=("LlamaForCausalLM",), model_type="llama",
        hf_trunk_class="LlamaForCausalLM", qkv_bias=False, qk_norm=False, mtp_layout=GLM_LAYOUT,
        has_mtp=False, vllm_mtp_drafter=False, rope_types=("default", "llama3"),
        unsupported_true_keys=("attention_bias", "mlp_bias"),
    ),
}
# the dense families with MTP layers (tests build them in any dense shape: head counts, widths)
MTP_FAMILIES = tuple(name for name, fam in FAMILIES.items() if fam.has_mtp and not fam.moe)
# the mixture-of-experts families (all with MTP layers; their shapes are their own: MLA, experts)
MOE_FAMILIES = tuple(name for name, fam in FAMILIES.items() if fam.moe)
# every family with MTP layers: the engine, the trainer, the converters and weight sync run them all
# (and scripts/make_tiny_model.py makes them)
ENGINE_MTP_FAMILIES = tuple(name for name, fam in FAMILIES.items() if fam.has_mtp)
DEFAULT_FAMILY = "mimo"


def family_of_hf_config(raw, source="config.json"):
    """The family of an HF config dict: by `architectures`, else by `model_type`; one-line refusal."""
    archs = raw.get("architectures") or []
    for fam in FAMILIES.values():
        if any(a in fam.architectures for a in archs):
            return fam
    if not archs:
        for fam in FAMILIES.values():
            if raw.get("model_type") == fam.model_type:
                return fam
    raise UserError(f"{source}: architectures {archs} / model_type {raw.get('model_type')!r} is not a supported "
                    f"model family; vime supports {supported_families()}")


def supported_families():
    return ", ".join(f"{f.name} ({f.architectures[0]})" for f in FAMILIES.values())


def vllm_aux_hidden_state_families():
    """The families whose vLLM model gives an external draft its aux hidden states, for error messages."""
    return ", ".join(f"{f.name} ({f.architectures[0]})" for f in FAMILIES.values() if f.vllm_aux_hidden_states)


def get_family(name):
    if name not in FAMILIES:
        raise UserError(f"unknown model family {name!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def swap_halves(weight):
    """[H, 2H] -> the same matrix with its two column halves exchanged."""
    half = weight.shape[1] // 2
    return torch.cat([weight[:, half:], weight[:, :half]], dim=1).contiguous()


def mtp_layer_indices(names, layout, num_hidden_layers):
    """Sorted MTP indices k present in `names` under `layout`."""
    pattern = layout.pattern()
    found = set()
    for name in names:
        m = pattern.match(name)
        if m:
            number = int(m.group(1))
            k = number - num_hidden_layers if "{n}" in layout.prefix else number
            if k >= 0:
                found.add(k)
    return sorted(found)


def layout_name(name, layout, num_hidden_layers):
    """The name `layout` stores the tensor of canonical `name` under (an MTP layer's renamed, others kept)."""
    m = CANONICAL_LAYOUT.pattern().match(name)
    if not m or int(m.group(1)) < num_hidden_layers:
        return name
    suffix, k = name[m.end():], int(m.group(1)) - num_hidden_layers
    return f"{layout.layer_prefix(k, num_hidden_layers)}.{layout.renames.get(suffix, suffix)}"


def _rename_mtp(state, src, dst, num_hidden_layers, num_mtp_layers):
    out = dict(state)
    for k in range(num_mtp_layers):
        src_prefix = src.layer_prefix(k, num_hidden_layers) + "."
        dst_prefix = dst.layer_prefix(k, num_hidden_layers) + "."
        for name in [n for n in out if n.startswith(src_prefix)]:
            tensor = out.pop(name)
            suffix = name[len(src_prefix):]
            if suffix in src.shared_copies:
                continue
            canonical = {v: c for c, v in src.renames.items()}.get(suffix, suffix)
            if canonical == "eh_proj.weight" and src.hidden_first != dst.hidden_first:
                tensor = swap_halves(tensor)
            out[dst_prefix + dst.renames.get(canonical, canonical)] = tensor
    return out


def _as_layout(layout_or_family):
    """An MTPLayout, given one or a family name."""
    if isinstance(layout_or_family, MTPLayout):
        return layout_or_family
    return get_family(layout_or_family).mtp_layout


def to_canonical(state, layout, num_hidden_layers, num_mtp_layers):
    """Rename a checkpoint's tensors from `layout` (an MTPLayout or a family name) to canonical names."""
    return _rename_mtp(state, _as_layout(layout), CANONICAL_LAYOUT, num_hidden_layers, num_mtp_layers)


def from_canonical(state, layout, num_hidden_layers, num_mtp_layers):
    """Rename canonical tensors to the names `layout` (an MTPLayout or a family name) stores them under."""
    return _rename_mtp(state, CANONICAL_LAYOUT, _as_layout(layout), num_hidden_layers, num_mtp_layers)


def is_mtp_name(name, num_hidden_layers):
    """True for a canonical name that belongs to an MTP layer."""
    m = CANONICAL_LAYOUT.pattern().match(name)
    return bool(m) and int(m.group(1)) >= num_hidden_layers
