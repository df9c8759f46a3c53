"""The registry of MTP checkpoint layouts (pure: no Ray/Megatron imports).

Inside vime every tensor has a *canonical* Hugging Face name: the standard Qwen3 trunk
names plus MTP layer k under `model.layers.{num_hidden_layers + k}.*` (the GLM-4.5 /
DeepSeek-V3 layout, `eh_proj` applied to cat(enorm(embedding), hnorm(hidden))).
Other layouts differ only in the MTP prefix, four renamed tensors and the order of the
two column halves of `eh_proj`; each is one declarative entry in `MTP_LAYOUTS`.
"""
import re
from dataclasses import dataclass, field

import torch

CANONICAL_LAYOUT = "glm"


@dataclass(frozen=True)
class MTPLayout:
    """How one model family stores its MTP layers."""

    name: str
    prefix: str  # format string; {n} = num_hidden_layers + k, {k} = MTP index
    renames: dict = field(default_factory=dict)  # canonical suffix -> this layout's suffix
    hidden_first: bool = False  # True: eh_proj columns are [hidden ; embedding]
    shared_copies: tuple = ()  # per-layer copies of shared tensors, dropped on load

    def layer_prefix(self, k, num_hidden_layers):
        return self.prefix.format(n=num_hidden_layers + k, k=k)

    def pattern(self):
        return re.compile("^" + re.escape(self.prefix).replace(r"\{n\}", r"(\d+)").replace(r"\{k\}", r"(\d+)") + r"\.")


MTP_LAYOUTS = {
    "glm": MTPLayout(
        name="glm",
        prefix="model.layers.{n}",
        shared_copies=("embed_tokens.weight", "shared_head.head.weight"),
    ),
    "mimo": MTPLayout(
        name="mimo",
        prefix="model.mtp_layers.{k}",
        renames={
            "enorm.weight": "token_layernorm.weight",
            "hnorm.weight": "hidden_layernorm.weight",
            "eh_proj.weight": "input_proj.weight",
            "shared_head.norm.weight": "final_layernorm.weight",
        },
        hidden_first=True,
    ),
}


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


def detect_layout(names, num_hidden_layers):
    """Name of the layout whose MTP tensors appear in `names`, or None if there are none."""
    for layout in MTP_LAYOUTS.values():
        if mtp_layer_indices(names, layout, num_hidden_layers):
            return layout.name
    return None


def _rename_mtp(state, src, dst, num_hidden_layers, num_mtp_layers):
    out = {}
    for name, tensor in state.items():
        out[name] = tensor
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


def to_canonical(state, layout_name, num_hidden_layers, num_mtp_layers):
    """Rename a checkpoint's tensors from `layout_name` to vime's canonical names."""
    return _rename_mtp(state, MTP_LAYOUTS[layout_name], MTP_LAYOUTS[CANONICAL_LAYOUT],
                       num_hidden_layers, num_mtp_layers)


def from_canonical(state, layout_name, num_hidden_layers, num_mtp_layers):
    """Rename canonical tensors to the names `layout_name` stores them under."""
    return _rename_mtp(state, MTP_LAYOUTS[CANONICAL_LAYOUT], MTP_LAYOUTS[layout_name],
                       num_hidden_layers, num_mtp_layers)


def is_mtp_name(name, num_hidden_layers):
    """True for a canonical name that belongs to an MTP layer."""
    m = MTP_LAYOUTS[CANONICAL_LAYOUT].pattern().match(name)
    return bool(m) and int(m.group(1)) >= num_hidden_layers
