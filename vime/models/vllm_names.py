"""vLLM parameter names -> checkpoint tensor names, for reading vLLM's weights back (pure).

vLLM renames and fuses checkpoint tensors when it loads them: q/k/v projections become one
`qkv_proj`, gate/up one `gate_up_proj` (rows stacked in that order), MLA's two down-projections
one `fused_qkv_a_proj`, a layer's routed experts two FusedMoE parameters (`w13_weight`: each
expert's gate and up rows; `w2_weight`: its down projection), the vocabulary is padded to a
multiple of 64 rows, and the drafters store MTP layer k with its decoder layer under `mtp_block`
(MiMo's as `model.mtp_layers.{num_hidden_layers + k}`, GLM-4.5's and DeepSeek-V3's under the
checkpoint's `model.layers.{num_hidden_layers + k}`). These tables undo that so a parameter read
from vLLM can be compared with the tensor sent.
`update_rounds` goes the other way: it cuts an update into the loads vLLM makes (target, drafter),
under checkpoint names, for both ways weights enter vLLM (in-place reload, NCCL transfer).
"""
import re

from vime.models.draft_kinds import EXTERNAL_KINDS, external_draft_prefix, is_draft_name
from vime.models.families import from_canonical, is_mtp_name
from vime.precision import dtype_name

# fused vLLM module name -> the checkpoint modules stacked in it (dim 0, in this order)
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}  # MLA's down-projections (q LoRA, latent)
# vLLM's FusedMoE holds every routed expert of a layer in one parameter, [expert, rows, cols]:
# w13 stacks each expert's gate and up rows, w2 its down projection
FUSED_EXPERTS = {"w13_weight": ("gate_proj", "up_proj"), "w2_weight": ("down_proj",)}
_EXPERTS_MODULE = re.compile(r"^(.*\.experts)(\.routed_experts)?$")
# GLM-4.5 / DeepSeek-V3 drafters (vLLM's glm4_moe_mtp, deepseek_mtp) keep MTP layer k under the
# checkpoint's number L + k, its decoder layer under `mtp_block`, next to the MTP layer's own modules
_GLM_MTP_LAYER = re.compile(r"^model\.layers\.(\d+)\.(?=mtp_block\.|enorm\.|hnorm\.|eh_proj\.|shared_head\.)")

_DRAFT_LAYER = re.compile(r"^model\.mtp_layers\.(\d+)\.")


# vLLM drafter module -> checkpoint module of each external draft's tensors, by wire prefix (each kind's
# descriptor: `L` is the target's layers, after which vLLM numbers the draft's)
EXTERNAL_DRAFTER_NAMES = {kind.wire_prefix: kind.format.vllm_names for kind in EXTERNAL_KINDS}


def draft_to_checkpoint_name(name, num_hidden_layers, sent_shapes=()):
    """Drafter parameter name (vLLM) -> checkpoint name: MiMo's MTP layers, or an external draft's
    tensors under their wire names (`<kind>.<checkpoint name>`; the kind is the one whose names
    `sent_shapes` holds); None for tensors the drafter shares with the target (the embedding) and
    for an external drafter's when nothing of it was sent."""
    m = _DRAFT_LAYER.match(name)
    if m:
        k = int(m.group(1)) - num_hidden_layers
        return f"model.mtp_layers.{k}." + name[m.end():].replace("mtp_block.", "", 1)
    m = _GLM_MTP_LAYER.match(name)
    if m and int(m.group(1)) >= num_hidden_layers:
        return name.replace("mtp_block.", "", 1)
    prefix = next((external_draft_prefix(n) for n in sent_shapes if external_draft_prefix(n)), None)
    for vllm_module, ckpt_module in EXTERNAL_DRAFTER_NAMES.get(prefix, ()):
        # only names the trainer sent are compared (unpack): a MiMo drafter's are never external
        found = re.match(vllm_module.replace("{L}", str(num_hidden_layers)), name)
        if found:
            layer = [int(g) - num_hidden_layers for g in found.groups()]
            return prefix + ckpt_module.format(*layer) + name[found.end():]
    return None


def unpack(name, tensor, sent_shapes):
    """[(checkpoint name, tensor)] held by one vLLM parameter (already in checkpoint naming),
    or [] when it holds nothing comparable (an emptied, repacked weight; an unknown name)."""
    if tensor.numel() == 0:
        return []
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in PACKED:
        return _split_rows(tensor, [f"{parent}.{p}.{leaf}" for p in PACKED[last]], sent_shapes)
    experts = _EXPERTS_MODULE.match(module)
    if experts and leaf in FUSED_EXPERTS:
        per_expert = [_split_rows(t, [f"{experts.group(1)}.{e}.{p}.weight" for p in FUSED_EXPERTS[leaf]], sent_shapes)
                      for e, t in enumerate(tensor)]
        return [pair for parts in per_expert for pair in parts] if all(per_expert) else []
    if name not in sent_shapes:
        return []
    rows = sent_shapes[name][0] if sent_shapes[name] else None
    if rows is not None and tensor.dim() >= 1 and tensor.shape[0] > rows:
        tensor = tensor[:rows]  # padded vocabulary rows
    return [(name, tensor)] if tuple(tensor.shape) == tuple(sent_shapes[name]) else []


def _split_rows(tensor, parts, sent_shapes):
    """[(part name, its rows)] of a tensor stacking the sent `parts` along dim 0 (in order), or []
    when a part was not sent or the shapes do not add up."""
    if not all(p in sent_shapes for p in parts):
        return []
    sizes = [sent_shapes[p][0] for p in parts]
    if sum(sizes) != tensor.shape[0]:
        return []
    pairs = list(zip(parts, tensor.split(sizes, dim=0)))
    return pairs if all(tuple(t.shape) == tuple(sent_shapes[p]) for p, t in pairs) else []


def checkpoint_names(canonical, layout, num_hidden_layers, num_mtp_layers):
    """Canonical tensors under the checkpoint's names (its family's MTP layout; as they are without one)."""
    return from_canonical(canonical, layout, num_hidden_layers, num_mtp_layers) if layout else canonical


def update_rounds(canonical, layout, num_hidden_layers, num_mtp_layers, has_draft):
    """Canonical tensors sent to vLLM -> [(kind, {checkpoint name: tensor})], the loads a weight
    update makes in order: "target" (the trunk), then into the drafter either "mtp" (the MTP
    layers with the embedding and head they share, so a drafter with its own copies stays
    current) or an external draft's wire prefix (`<kind>.`: its tensors, sent as `<prefix><name>`,
    loaded under their own names). Draft tensors are dropped when vLLM runs no drafter."""
    model = (layout, num_hidden_layers, num_mtp_layers)
    trunk = {k: v for k, v in canonical.items() if not is_draft_name(k, num_hidden_layers)}
    mtp = {k: v for k, v in canonical.items() if is_mtp_name(k, num_hidden_layers)}
    rounds = [("target", checkpoint_names(trunk, *model))] if trunk else []
    if mtp and has_draft:
        shared = {k: v for k, v in trunk.items() if "embed_tokens" in k or k.startswith("lm_head")}
        rounds.append(("mtp", checkpoint_names({**mtp, **shared}, *model)))
    for prefix in EXTERNAL_DRAFTER_NAMES:
        external = {k[len(prefix):]: v for k, v in canonical.items() if k.startswith(prefix)}
        if external and has_draft:
            rounds.append((prefix, external))
    return rounds


def round_info(named):
    """vLLM's per-round update info (names, dtype names, shapes, in sending order) of {name: tensor}."""
    return {"names": list(named), "dtype_names": [dtype_name(t.dtype) for t in named.values()],
            "shapes": [list(t.shape) for t in named.values()]}
