"""Reading and writing vime's Hugging Face checkpoint directories (pure torch + safetensors).

A directory holds `config.json` (a family's HF config with `num_nextn_predict_layers`),
`model.safetensors` and the tokenizer files. `load_hf_checkpoint` validates it and returns
the config and the tensors under canonical names (see families.py); `save_hf_checkpoint`
writes them in the config's family layout.
"""
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vime.models.config_checks import check_finite_state, check_raw_config
from vime.models.families import (DEFAULT_FAMILY, FAMILIES, family_of_hf_config, from_canonical, layout_name,
                                  mtp_layer_indices, to_canonical)
from vime.models.moe_mla_config import (MLAConfig, MoEConfig, check_unsupported, parse_glm_attention, parse_mla,
                                        parse_moe, parse_partial_rotary, parse_rope_scaling)
from vime.models.rope import Llama3Scaling, YarnScaling
from vime.models.tensor_check import Expected, safetensors_shapes, tensor_mismatch
from vime.errors import UserError, require
from vime.paths import require_dir

# transformers 5 writes a chat template beside tokenizer_config.json, in chat_template.jinja
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture fields vime reads from an HF `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    num_nextn_predict_layers: int = 0
    bos_token_id: int = None
    eos_token_id: int = None
    pad_token_id: int = None
    family: str = DEFAULT_FAMILY  # a key of vime.models.families.FAMILIES
    # read from the config only by the families that have them (GLM-4.5, DeepSeek-V3)
    partial_rotary_factor: float = 1.0  # share of each head's channels RoPE rotates
    attention_bias: bool = None  # q/k/v bias; None: the family's
    use_qk_norm: bool = None  # per-head q/k RMSNorm; None: the family's
    moe: MoEConfig = None  # None: every layer has a dense MLP
    mla: MLAConfig = None  # None: grouped-query attention
    rope_yarn: YarnScaling = None  # None: no YaRN
    rope_llama3: Llama3Scaling = None  # None: no Llama 3 frequency scaling

    @property
    def model_family(self):
        return FAMILIES[self.family]

    @property
    def qkv_bias(self):
        return self.model_family.qkv_bias if self.attention_bias is None else self.attention_bias

    @property
    def qk_norm(self):
        return self.model_family.qk_norm if self.use_qk_norm is None else self.use_qk_norm

    @property
    def rotary_dim(self):
        """Channels RoPE rotates per head: MLA's rope part, else head_dim * partial_rotary_factor."""
        return self.mla.qk_rope_head_dim if self.mla else int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_dict(cls, d, source="config.json"):
        family = family_of_hf_config(d, source)
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in d]
        require(not missing, f"{source}: missing keys {missing}; not a {family.architectures[0]} config")
        rope = d.get("rope_parameters") or {}
        eos = d.get("eos_token_id")
        natural_head_dim = d["hidden_size"] // d["num_attention_heads"]
        require(family.head_dim_free or d.get("head_dim") in (None, natural_head_dim),
                f"{source}: head_dim {d.get('head_dim')} must be hidden_size / num_attention_heads = "
                f"{natural_head_dim} for {family.architectures[0]}")
        fields = dict(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
            max_position_embeddings=d.get("max_position_embeddings", 512),
            tie_word_embeddings=d.get("tie_word_embeddings", True),
            num_nextn_predict_layers=d.get("num_nextn_predict_layers", 0) or 0,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            pad_token_id=d.get("pad_token_id"), family=family.name,
        )
        fields.update(family_keys(d, family, source))
        return cls(**fields)

    def to_hf_dict(self):
        fam = self.model_family
        d = asdict(self)
        for key in ("family", *FAMILY_KEY_FIELDS):
            del d[key]
        d.update(model_type=fam.model_type, architectures=list(fam.architectures[:1]), hidden_act="silu",
                 attention_bias=self.qkv_bias, attention_dropout=0.0, torch_dtype="float32",
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                 use_cache=True, use_sliding_window=False)
        d.update(family_hf_keys(self))
        return d


# ModelConfig fields that only some families' configs carry (family_keys / family_hf_keys)
FAMILY_KEY_FIELDS = ("partial_rotary_factor", "attention_bias", "use_qk_norm", "moe", "mla", "rope_yarn",
                     "rope_llama3")


def family_keys(d, family, source):
    """The ModelConfig fields of the RoPE scaling / MoE / MLA / GLM attention keys `family` reads from config
    dict `d`; keys whose value changes the forward pass in a way vime does not build are refused."""
    arch = family.architectures[0]
    check_unsupported(d, source, arch)
    for key in family.unsupported_true_keys:
        require(not d.get(key), f"{source}: {key} true is not supported for {arch} (vime builds it without those "
                "biases); only checkpoints with it false convert")
    out = parse_rope_scaling(d, source, family)
    if not (family.moe or family.attention == "mla" or family.qkv_from_config):
        return out
    if family.moe:
        out["moe"] = parse_moe(d, source)
    if family.qkv_from_config:
        out["attention_bias"], out["use_qk_norm"] = parse_glm_attention(d, source)
    if family.attention == "mla":
        mla = out["mla"] = parse_mla(d, source)
        # MLA has one latent per token, not KV heads: every head reads it
        out.update(head_dim=mla.qk_head_dim, num_key_value_heads=d["num_attention_heads"])
    else:
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        out["partial_rotary_factor"] = parse_partial_rotary(d, source, head_dim)
    return out


def family_hf_keys(cfg):
    """The config.json keys of `cfg`'s MoE / MLA / GLM attention / RoPE fields, as the public configs spell them."""
    out = {}
    if cfg.use_qk_norm is not None:
        out["use_qk_norm"] = cfg.use_qk_norm
    if cfg.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = cfg.partial_rotary_factor
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                  "partial_rotary_factor": cfg.partial_rotary_factor}
    if cfg.rope_yarn is not None:
        out["rope_parameters"] = {"rope_type": "yarn", "rope_theta": cfg.rope_theta,
                                  **{k: v for k, v in asdict(cfg.rope_yarn).items() if v is not None}}
    if cfg.rope_llama3 is not None:
        out["rope_parameters"] = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **asdict(cfg.rope_llama3)}
    if cfg.moe is not None:
        out.update(asdict(cfg.moe), scoring_func="sigmoid", topk_method="noaux_tc")
    if cfg.mla is not None:
        out.update(asdict(cfg.mla), head_dim=cfg.mla.qk_rope_head_dim)
    return out


def expected_hf_tensors(cfg, num_mtp_layers=None):
    """{canonical name: Expected(shape, config keys)} of every tensor a complete checkpoint of `cfg` with
    `num_mtp_layers` MTP layers (default: the config's) holds: what `config.json` implies, the one
    statement of it that the tensor check (`hf_tensor_problem`) compares files against."""
    h, n_mtp = cfg.hidden_size, cfg.num_nextn_predict_layers if num_mtp_layers is None else num_mtp_layers
    out = {"model.embed_tokens.weight": Expected((cfg.vocab_size, h), "vocab_size, hidden_size"),
           "model.norm.weight": Expected((h,), "hidden_size")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = Expected((cfg.vocab_size, h), "vocab_size, hidden_size, tie_word_embeddings")
    for i in range(cfg.num_hidden_layers + n_mtp):
        out.update({f"model.layers.{i}.{suffix}": e for suffix, e in layer_tensors(cfg, i).items()})
    mtp = "num_nextn_predict_layers, hidden_size"
    for k in range(n_mtp):
        prefix = f"model.layers.{cfg.num_hidden_layers + k}"
        out.update({f"{prefix}.enorm.weight": Expected((h,), mtp), f"{prefix}.hnorm.weight": Expected((h,), mtp),
                    f"{prefix}.eh_proj.weight": Expected((h, 2 * h), mtp),
                    f"{prefix}.shared_head.norm.weight": Expected((h,), mtp)})
    return out


def expected_tensor_names(cfg, num_mtp_layers=None):
    """Canonical names a complete checkpoint with `num_mtp_layers` MTP layers must hold."""
    return list(expected_hf_tensors(cfg, num_mtp_layers))


def attention_tensors(cfg):
    """{canonical suffix: Expected} of one layer's attention: grouped-query, or latent (MLA)."""
    h, heads, mla = cfg.hidden_size, cfg.num_attention_heads, cfg.mla
    if mla is not None:
        q_head = "num_attention_heads, qk_nope_head_dim, qk_rope_head_dim"
        out = ({"self_attn.q_a_proj.weight": Expected((mla.q_lora_rank, h), "q_lora_rank, hidden_size"),
                "self_attn.q_a_layernorm.weight": Expected((mla.q_lora_rank,), "q_lora_rank"),
                "self_attn.q_b_proj.weight": Expected((heads * mla.qk_head_dim, mla.q_lora_rank),
                                                      f"{q_head}, q_lora_rank")}
               if mla.q_lora_rank else
               {"self_attn.q_proj.weight": Expected((heads * mla.qk_head_dim, h), f"{q_head}, hidden_size, q_lora_rank")})
        out.update({
            "self_attn.kv_a_proj_with_mqa.weight": Expected((mla.latent_width, h),
                                                            "kv_lora_rank, qk_rope_head_dim, hidden_size"),
            "self_attn.kv_a_layernorm.weight": Expected((mla.kv_lora_rank,), "kv_lora_rank"),
            "self_attn.kv_b_proj.weight": Expected((heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
                                                   "num_attention_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank"),
            "self_attn.o_proj.weight": Expected((h, heads * mla.v_head_dim), "hidden_size, num_attention_heads, v_head_dim")})
        return out
    q, kv = heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    q_keys, kv_keys = "num_attention_heads, head_dim", "num_key_value_heads, head_dim"
    out = {"self_attn.q_proj.weight": Expected((q, h), f"{q_keys}, hidden_size"),
           "self_attn.k_proj.weight": Expected((kv, h), f"{kv_keys}, hidden_size"),
           "self_attn.v_proj.weight": Expected((kv, h), f"{kv_keys}, hidden_size"),
           "self_attn.o_proj.weight": Expected((h, q), f"hidden_size, {q_keys}")}
    if cfg.qkv_bias:
        out.update({"self_attn.q_proj.bias": Expected((q,), f"{q_keys}, attention_bias"),
                    "self_attn.k_proj.bias": Expected((kv,), f"{kv_keys}, attention_bias"),
                    "self_attn.v_proj.bias": Expected((kv,), f"{kv_keys}, attention_bias")})
    if cfg.qk_norm:
        out.update({"self_attn.q_norm.weight": Expected((cfg.head_dim,), "head_dim, use_qk_norm"),
                    "self_attn.k_norm.weight": Expected((cfg.head_dim,), "head_dim, use_qk_norm")})
    return out


def swiglu_tensors(prefix, width, hidden, keys):
    """{suffix: Expected} of one SwiGLU block (gate, up, down) `width` wide."""
    return {f"{prefix}gate_proj.weight": Expected((width, hidden), f"{keys}, hidden_size"),
            f"{prefix}up_proj.weight": Expected((width, hidden), f"{keys}, hidden_size"),
            f"{prefix}down_proj.weight": Expected((hidden, width), f"hidden_size, {keys}")}


def mlp_tensors(cfg, index):
    """{canonical suffix: Expected} of decoder layer `index`'s MLP: dense, or router + experts + shared experts."""
    h, moe = cfg.hidden_size, cfg.moe
    if moe is None or not moe.is_moe_layer(index):
        keys = "intermediate_size" + (", first_k_dense_replace" if moe is not None else "")
        return swiglu_tensors("mlp.", cfg.intermediate_size, h, keys)
    e = moe.n_routed_experts
    out = {"mlp.gate.weight": Expected((e, h), "n_routed_experts, hidden_size"),
           "mlp.gate.e_score_correction_bias": Expected((e,), "n_routed_experts")}
    for expert in range(e):
        out.update(swiglu_tensors(f"mlp.experts.{expert}.", moe.moe_intermediate_size, h,
                                  "n_routed_experts, moe_intermediate_size"))
    if moe.n_shared_experts:
        out.update(swiglu_tensors("mlp.shared_experts.", moe.moe_intermediate_size * moe.n_shared_experts, h,
                                  "n_shared_experts, moe_intermediate_size"))
    return out


def layer_tensors(cfg, index):
    """{canonical suffix: Expected} of decoder layer `index` (MTP layers continue the numbering)."""
    norm = Expected((cfg.hidden_size,), "hidden_size")
    return {"input_layernorm.weight": norm, "post_attention_layernorm.weight": norm,
            **attention_tensors(cfg), **mlp_tensors(cfg, index)}


# an extra tensor's name -> the config key that would describe it (the first that matches)
EXTRA_TENSOR_KEYS = (
    (re.compile(r"\.shared_experts\."), "n_shared_experts"),
    (re.compile(r"\.experts\.\d+\."), "n_routed_experts"),
    (re.compile(r"\.mlp\.(gate\.|gate_proj|up_proj|down_proj)"), "first_k_dense_replace"),
    (re.compile(r"^lm_head\."), "tie_word_embeddings"),
    (re.compile(r"_proj\.bias$"), "attention_bias"),
    (re.compile(r"\.[qk]_norm\."), "use_qk_norm"),
    (re.compile(r"\.(q_a_proj|q_a_layernorm|q_b_proj|q_proj)\."), "q_lora_rank"),
)


MOE_TENSOR = re.compile(r"\.mlp\.(gate\.|experts\.|shared_experts\.)")


def extra_tensor_key(name, cfg):
    """The config key that would describe tensor `name`, which `cfg` does not imply (None: none known)."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    index = int(layer.group(1)) if layer else None
    if index is not None and index >= cfg.num_hidden_layers + cfg.num_nextn_predict_layers:
        return "num_hidden_layers, num_nextn_predict_layers"
    if index is not None and cfg.moe is not None and not cfg.moe.is_moe_layer(index) and MOE_TENSOR.search(name):
        return "first_k_dense_replace"  # experts in a layer the config keeps dense
    return next((key for pattern, key in EXTRA_TENSOR_KEYS if pattern.search(name)), None)


def hf_tensor_problem(cfg, held):
    """What is wrong with a checkpoint's tensors `held` ({name as stored: shape}) against config `cfg`
    (its MTP layers included, in the family's storage layout), or None: the tensor check of this format,
    run by `inspect_hf_checkpoint` and so by the engine, the trainer, the converters and generate."""
    layout = cfg.model_family.mtp_layout
    expected = {layout_name(n, layout, cfg.num_hidden_layers): e for n, e in expected_hf_tensors(cfg).items()}
    copy_shape = Expected((cfg.vocab_size, cfg.hidden_size), "vocab_size, hidden_size (a copy of the trunk's)")
    for k in range(cfg.num_nextn_predict_layers):  # copies of the embedding and head some checkpoints store
        for copy in layout.shared_copies:
            name = f"{layout.layer_prefix(k, cfg.num_hidden_layers)}.{copy}"
            if name in held:
                expected[name] = copy_shape
    return tensor_mismatch(expected, held, explain_extra=lambda name: extra_tensor_key(name, cfg))


def read_config(path, flag="--hf-checkpoint"):
    """ModelConfig of an HF checkpoint directory, with one-line errors for a bad directory that name
    `flag`, the option the user gave the directory with."""
    require_dir(path, flag, "; make one with `python scripts/make_tiny_model.py --out DIR`")
    cfg_file = os.path.join(path, "config.json")
    require(os.path.isfile(cfg_file), f"{flag} {path}: config.json is missing; not an HF checkpoint directory")
    return config_from_raw(read_json(cfg_file), cfg_file)


def read_json(path):
    """The JSON value in file `path`, with a one-line error for malformed JSON or a file that is not text."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: malformed JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a JSON text file (its bytes are not UTF-8 text: a binary file?)") from None


def json_kind(value):
    """A JSON value described for a one-line message: its type, and its value when short ("the string "64"")."""
    if isinstance(value, bool):
        return f"the boolean {json.dumps(value)}"
    for kind, name in ((int, "integer"), (float, "number"), (str, "string")):
        if isinstance(value, kind):
            return f"the {name} {json.dumps(value)[:40]}"
    return {list: "a list", dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def config_from_raw(raw, source):
    """ModelConfig of the config.json dict `raw` read from `source`, its values checked first."""
    check_raw_config(raw, source)
    return ModelConfig.from_hf_dict(raw, source=source)


def _weights_file(path, flag="--hf-checkpoint"):
    weights = os.path.join(path, "model.safetensors")
    require(os.path.isfile(weights), f"{flag} {path}: model.safetensors is missing; the checkpoint is incomplete")
    return weights


def _check_tensors(cfg, held, weights):
    """One-line errors when the tensors `held` ({name: shape} of `weights`) disagree with the config:
    quantised tensors, MTP layers other than declared, then every tensor's name and shape."""
    quantised = [n for n in held if n.endswith("_scale_inv")]
    require(not quantised, f"{weights}: quantised tensors ({quantised[0] if quantised else ''}, ...) are not "
            "supported; dequantise the checkpoint to bf16/fp32 first")
    n_found = len(mtp_layer_indices(held, cfg.model_family.mtp_layout, cfg.num_hidden_layers))
    declared = cfg.num_nextn_predict_layers
    require(n_found <= declared,
            f"{weights}: the file holds {n_found} MTP layers but config.json declares num_nextn_predict_layers="
            f"{declared}; set num_nextn_predict_layers to {n_found} in config.json (the draft would be ignored)")
    require(n_found == declared,
            f"{weights}: config.json declares num_nextn_predict_layers={declared} "
            f"but the file holds {n_found} MTP layers; the checkpoint is incomplete")
    problem = hf_tensor_problem(cfg, held)
    require(problem is None, f"{weights} disagrees with config.json: {problem}; fix config.json or re-convert the "
            f"weights (a {cfg.model_family.architectures[0]} checkpoint)")


def inspect_hf_checkpoint(path, flag="--hf-checkpoint"):
    """ModelConfig of an HF checkpoint, validated from the safetensors header alone (`flag` as in
    `read_config`)."""
    cfg = read_config(path, flag)
    weights = _weights_file(path, flag)
    try:
        held = safetensors_shapes(weights)
    except Exception as e:  # safetensors raises its own error types for truncated files
        raise UserError(f"{weights}: unreadable safetensors file ({e}); re-create or re-download it") from None
    _check_tensors(cfg, held, weights)
    return cfg


def load_hf_checkpoint(path, flag="--hf-checkpoint"):
    """(ModelConfig, canonical state dict, family name) of a validated HF checkpoint directory
    (`flag` as in `read_config`)."""
    cfg = inspect_hf_checkpoint(path, flag)
    weights = _weights_file(path, flag)
    try:
        raw = load_file(weights)
    except Exception as e:  # safetensors raises its own error types for truncated files
        raise UserError(f"{weights}: unreadable safetensors file ({e}); re-create or re-download it") from None
    check_finite_state(raw, weights)
    check_shared_copies(cfg, raw, weights)
    state = to_canonical(raw, cfg.model_family.mtp_layout, cfg.num_hidden_layers, cfg.num_nextn_predict_layers)
    return cfg, state, cfg.family


def shared_copy_sources(cfg):
    """{suffix of an MTP layer's copy: the main tensor it copies} (embedding and output head)."""
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    return {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": head}


def check_shared_copies(cfg, raw, weights):
    """An MTP layer's own copies of the embedding and output head (DeepSeek-V3 and GLM-4.5 store
    them; GLM-4.6 omits them and the main ones serve) must equal the main ones: vime's MTP layers
    share the trunk's, as megatron-core's MTP block does, so a different copy is refused, not dropped."""
    layout = cfg.model_family.mtp_layout
    for k in range(cfg.num_nextn_predict_layers):
        prefix = layout.layer_prefix(k, cfg.num_hidden_layers)
        for copy, main in shared_copy_sources(cfg).items():
            name = f"{prefix}.{copy}"
            if name in raw and copy in layout.shared_copies:
                require(torch.equal(raw[name], raw[main]),
                        f"{weights}: {name} differs from {main}; vime's MTP layers share the trunk's embedding "
                        f"and output head: drop the copy (GLM-4.6 stores none) or make it equal")


def has_mtp_head_copies(path, cfg):
    """True when checkpoint `path` stores its MTP layers' own copies of the embedding and output head
    (DeepSeek-V3, GLM-4.5; GLM-4.6 stores none), read from the safetensors header."""
    layout = cfg.model_family.mtp_layout
    if not (layout.shared_copies and cfg.num_nextn_predict_layers):
        return False
    with safe_open(_weights_file(path), framework="pt") as f:
        names = set(f.keys())
    return f"{layout.layer_prefix(0, cfg.num_hidden_layers)}.{layout.shared_copies[0]}" in names


def with_mtp_head_copies(named, cfg):
    """`named` (the family layout's names) plus each MTP layer's copies of the embedding and output head."""
    sources, layout = shared_copy_sources(cfg), cfg.model_family.mtp_layout
    out = dict(named)
    for k in range(cfg.num_nextn_predict_layers):
        for copy in layout.shared_copies:
            # a storage of its own: safetensors refuses to write tensors that share one
            out[f"{layout.layer_prefix(k, cfg.num_hidden_layers)}.{copy}"] = named[sources[copy]].clone()
    return out


def save_hf_checkpoint(path, cfg, state, tokenizer_dir=None, mtp_head_copies=False):
    """Write `state` (canonical names) as an HF directory in the config's family layout; copy tokenizer
    files. mtp_head_copies: also write each MTP layer's copies of the shared embedding and head."""
    os.makedirs(path, exist_ok=True)
    named = from_canonical(state, cfg.model_family.mtp_layout, cfg.num_hidden_layers, cfg.num_nextn_predict_layers)
    if mtp_head_copies:
        named = with_mtp_head_copies(named, cfg)
    save_file({k: v.detach().contiguous().cpu() for k, v in named.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    if tokenizer_dir and os.path.abspath(tokenizer_dir) != os.path.abspath(path):
        for name in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(path, name))
