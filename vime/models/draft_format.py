"""The external-draft checkpoint format (pure): a directory vLLM loads as a drafter, `config.json` +
`model.safetensors`, written once for every external kind.

What kinds share is here: reading and writing the directory, the config.json fields of every draft's
layers (`DraftShape`: widths, heads, vocabulary, the target width it reads, norm epsilon, rotary), the
fit against the target (its width and vocabulary, the tensors it must not store because it reads the
target's), and the comparison of the tensors with what the config implies (`tensor_check`: every
missing, extra or mis-shaped tensor named with the config key behind it), made from the file's
header before any tensor is read (then the few small tensors a kind's values check reads, e.g. EAGLE-3's
vocabulary tables). What differs is each kind's `ExternalFormat`: its architecture
name, its module (built on the meta device, it says which tensors a config implies), its own
config.json fields, its own fit checks, its vLLM names and the script that makes one.
"""
import json
import os
import re
from dataclasses import dataclass
from typing import Callable, Optional

from vime.errors import UserError, require
from vime.models.tensor_check import Expected, safetensors_shapes, tensor_mismatch

FLAG = "--vllm-speculative-config"
WEIGHTS = "model.safetensors"

# the config.json keys that shape each tensor of a draft layer, by its module's name
SHAPE_KEYS = {
    "q_proj": "num_attention_heads, head_dim, hidden_size", "o_proj": "num_attention_heads, head_dim, hidden_size",
    "k_proj": "num_key_value_heads, head_dim, hidden_size", "v_proj": "num_key_value_heads, head_dim, hidden_size",
    "q_norm": "head_dim", "k_norm": "head_dim", "gate_proj": "hidden_size, intermediate_size",
    "up_proj": "hidden_size, intermediate_size", "down_proj": "hidden_size, intermediate_size",
    "lm_head": "vocab_size, hidden_size",
}
_NUMBERED_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True)
class ExternalFormat:
    """How one external kind differs within the format (the rest is this module's, shared)."""

    architecture: str  # config.json `architectures`: vLLM picks its drafter model by it
    model: type  # the draft module (mtp/<kind>.py), built from the kind's config
    to_hf: Callable  # model config -> the kind's own config.json entries (over the shared ones)
    from_hf: Callable  # (config.json dict, its shared fields, path) -> model config; KeyError: a key is missing
    layer_ids_key: str  # the config.json key naming the target layers it reads
    make: str  # the script that makes one for a target
    fits: Optional[Callable] = None  # (path, cfg, target_cfg, num_speculative_tokens): the kind's own fit checks
    for_target: Optional[Callable] = None  # (cfg, target_cfg) -> cfg as it drafts for that target
    reads_from_target: tuple = ("embed_tokens.weight",)  # tensors it shares with the target, so never stores
    vllm_names: tuple = ()  # (vLLM drafter module pattern, checkpoint module); {L}: the target's layers
    config_hint: str = ""  # where config.json keeps the kind's own keys, said when one is missing
    tensor_keys: dict = None  # module name -> config keys for tensors SHAPE_KEYS does not cover
    check_values: Optional[Callable] = None  # (where, cfg, read): the kind's checks of tensor values, read(name)


# ---------------------------------------------------------------- config.json
def shape_for_target(target_cfg, intermediate_size=None):
    """The `DraftShape` fields of a draft made for `target_cfg` (a ModelConfig): its width, heads, vocabulary."""
    return dict(hidden_size=target_cfg.hidden_size, intermediate_size=intermediate_size or target_cfg.intermediate_size,
                num_attention_heads=target_cfg.num_attention_heads, num_key_value_heads=target_cfg.num_key_value_heads,
                head_dim=target_cfg.head_dim, vocab_size=target_cfg.vocab_size, target_hidden_size=target_cfg.hidden_size,
                rms_norm_eps=target_cfg.rms_norm_eps, rope_theta=target_cfg.rope_theta,
                max_position_embeddings=target_cfg.max_position_embeddings)


def _shape_to_hf(cfg):
    return {
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32",
    }


def _shape_from_hf(raw):
    heads = raw["num_attention_heads"]
    return dict(hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"], num_attention_heads=heads,
                num_key_value_heads=raw.get("num_key_value_heads", heads),
                head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, vocab_size=raw["vocab_size"],
                target_hidden_size=raw.get("target_hidden_size") or raw["hidden_size"],
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                rope_theta=(raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 10000.0)),
                max_position_embeddings=raw.get("max_position_embeddings", 256))


def to_hf_dict(kind, cfg):
    """config.json of a draft vLLM loads as the kind's architecture."""
    return {"architectures": [kind.format.architecture], **_shape_to_hf(cfg), **kind.format.to_hf(cfg)}


def not_a_draft(kind, path, why):
    article = "an" if kind.title[0] in "AEIOU" else "a"
    return UserError(f"{FLAG}: model {path} is not {article} {kind.title} draft ({why}); make one with "
                     f"`python {kind.format.make} --target CKPT --out DIR`")


def _read_json(kind, path):
    """The draft's config.json as a dict: the directory, the file, valid JSON, the architecture, the weights file."""
    cfg_file = os.path.join(str(path), "config.json")
    if not os.path.isdir(str(path)):
        raise not_a_draft(kind, path, "no such directory")
    if not os.path.isfile(cfg_file):
        raise not_a_draft(kind, path, "config.json is missing")
    try:
        with open(cfg_file) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise not_a_draft(kind, path, f"config.json is malformed JSON: {e.msg} at line {e.lineno}") from None
    architecture = kind.format.architecture
    if architecture not in (raw.get("architectures") or []):
        raise not_a_draft(kind, path, f"architectures {raw.get('architectures')} lack {architecture}")
    if not os.path.isfile(os.path.join(str(path), WEIGHTS)):
        raise not_a_draft(kind, path, f"{WEIGHTS} is missing")
    return raw


def read_config(kind, path):
    """The kind's model config of a draft directory; one line naming the directory when it is not a draft."""
    raw = _read_json(kind, path)
    try:
        return kind.format.from_hf(raw, _shape_from_hf(raw), path)
    except KeyError as e:
        hint = f" ({kind.format.config_hint})" if kind.format.config_hint else ""
        raise not_a_draft(kind, path, f"config.json lacks {e.args[0]!r}{hint}") from None


# ---------------------------------------------------------------- the fit against the target
def check_fits(kind, path, cfg, target_cfg, num_speculative_tokens=None, tensors=None):
    """The draft fits the target (width, vocabulary, the kind's own checks) and its tensors are the ones
    its config implies; `tensors` ({name: shape}) stands for the directory's file (an in-memory draft)."""
    require(cfg.target_hidden_size == target_cfg.hidden_size and cfg.hidden_size == target_cfg.hidden_size,
            f"{FLAG}: draft {path} has hidden size {cfg.hidden_size} (target_hidden_size {cfg.target_hidden_size}) "
            f"but the target's is {target_cfg.hidden_size}; make the draft for this target with {kind.format.make}")
    require(cfg.vocab_size == target_cfg.vocab_size,
            f"{FLAG}: draft {path} has vocab_size {cfg.vocab_size} but the target has {target_cfg.vocab_size}; "
            "the draft must share the target's tokenizer")
    if kind.format.fits is not None:
        kind.format.fits(path, cfg, target_cfg, num_speculative_tokens)
    check_tensors(kind, path, cfg, _read_weights(kind, path, safetensors_shapes) if tensors is None else tensors)


def _read_weights(kind, path, read):
    """`read`(the weights file): its tensors or their shapes; one line when the file is damaged."""
    try:
        return read(os.path.join(str(path), WEIGHTS))
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise not_a_draft(kind, path, f"unreadable {WEIGHTS}: {str(e).splitlines()[0]}") from None


def expected_tensors(kind, cfg):
    """{checkpoint name: Expected} of a draft of config `cfg`: its module built on the meta device, each
    tensor with the config keys that decide its existence and shape."""
    import torch

    with torch.device("meta"):
        module = kind.format.model(cfg)
    return {name: Expected(tuple(t.shape), _config_keys(kind, name)) for name, t in module.state_dict().items()}


def _config_keys(kind, name):
    module = name.split(".")[-2] if "." in name else name
    own = {"fc": f"hidden_size, target_hidden_size, {kind.format.layer_ids_key}", **(kind.format.tensor_keys or {})}
    keys = own.get(module) or SHAPE_KEYS.get(module, "hidden_size")
    return f"num_hidden_layers, {keys}" if _NUMBERED_LAYER.match(name) else keys


def _layer_count_key(name):
    """A tensor of a decoder layer past the config's count is explained by num_hidden_layers."""
    return "num_hidden_layers" if _NUMBERED_LAYER.match(name) else None


def check_tensors(kind, path, cfg, held, where=None):
    """The tensors held ({name: shape}) are exactly those `cfg` implies (one line naming the first of
    each disagreement with its config key); the target's own tensors stored in the draft are refused.
    `where` says whose tensors they are (default: the draft directory `path` of the speculative config)."""
    where = where or f"{FLAG}: draft {path}"
    own = [name for name in kind.format.reads_from_target if name in held]
    require(not own, f"{where} stores its own {own[0] if own else ''}; vime's {kind.title} draft reads the target's "
            f"(remove the tensor from {WEIGHTS})")
    mismatch = tensor_mismatch(expected_tensors(kind, cfg), held, _layer_count_key)
    require(mismatch is None, f"{where}: {WEIGHTS} does not hold what config.json describes: {mismatch}; fix "
            f"config.json or make the draft again with {kind.format.make}")


# ---------------------------------------------------------------- loading and saving
def _read_tensors(kind, path):
    from safetensors.torch import load_file

    return _read_weights(kind, path, load_file)


def load(kind, path):
    """(model config as config.json gives it, {checkpoint name: tensor}) of a draft directory."""
    return read_config(kind, path), _read_tensors(kind, path)


def for_target(kind, cfg, target_cfg):
    """The draft's config as it drafts for `target_cfg` (what its config.json leaves to the target filled in)."""
    return kind.format.for_target(cfg, target_cfg) if kind.format.for_target is not None else cfg


def check_directory(kind, path, target_cfg, num_speculative_tokens=None):
    """The draft directory `path` is the kind's and fits the target: its config, then its tensors from the
    file's header, then the values the kind checks (only those tensors read); returns its config as it
    drafts for the target."""
    cfg = for_target(kind, read_config(kind, path), target_cfg)
    check_fits(kind, path, cfg, target_cfg, num_speculative_tokens)
    if kind.format.check_values is not None:
        kind.format.check_values(f"{FLAG}: draft {path}", cfg, lambda name: _read_weights(
            kind, path, lambda file: _read_one(file, name)))
    return cfg


def _read_one(file, name):
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        return f.get_tensor(name)


def load_for_target(kind, path, target_cfg, num_speculative_tokens=None):
    """The draft module of a directory (float32, CPU), checked (`check_directory`) before any tensor is read."""
    module = kind.format.model(check_directory(kind, path, target_cfg, num_speculative_tokens))
    module.load_state_dict(_read_tensors(kind, path), strict=True)
    return module


def save(kind, path, cfg, state):
    """Write config.json and model.safetensors (the tensors, contiguous, on the CPU), once the tensors
    are checked to be what `cfg` describes (so that what is written loads; nothing is written otherwise)."""
    from safetensors.torch import save_file

    where = f"the {kind.title} draft to write to {path} (nothing written)"
    check_tensors(kind, path, cfg, {name: tuple(t.shape) for name, t in state.items()}, where=where)
    if kind.format.check_values is not None:
        kind.format.check_values(where, cfg, state.__getitem__)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(to_hf_dict(kind, cfg), f, indent=2)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, os.path.join(path, WEIGHTS))
