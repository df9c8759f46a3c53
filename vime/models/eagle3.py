"""The EAGLE-3 kind (pure): its descriptor, and its part of the external-draft format, vLLM's
`LlamaForCausalLMEagle3` directory.

config.json is a Llama config with one decoder layer, `draft_vocab_size`, `target_hidden_size` and
`eagle_aux_hidden_state_layer_ids`; model.safetensors holds the tensors of mtp/eagle3.py under the
names vLLM's `llama_eagle3.py` loads (no `embed_tokens`: the draft reads the target's, as vLLM shares
it with a draft that stores none). That is what `vllm.LLM(speculative_config={"method": "eagle3",
"model": DIR})` loads unchanged.

A `draft_vocab_size` below `vocab_size` is a reduced draft vocabulary (mtp/eagle3.py): `lm_head` has
that many rows and the file holds `d2t` (int64 [draft_vocab_size], target id = draft id + d2t) and
`t2d` (bool [vocab_size]), as EAGLE-3 and SpecForge checkpoints do; their values are checked when a
directory is read or written (distinct target ids in range, t2d marking exactly those).

Which target layers feed the draft: the ids written in config.json (vLLM reads
`eagle_aux_hidden_state_layer_ids` from the draft's config first), else vLLM's own choice
(2, L // 2, L - 3) for an L-layer target. Id i is the residual stream before target layer i. A new
draft for a target too shallow for vLLM's choice (fewer than 7 layers: the tiny GLM-4.5 and
DeepSeek-V3 models) reads the embedding output, the middle and the last layer's output.
"""
import dataclasses

from mtp.eagle3 import Eagle3Config, Eagle3Draft
from vime.errors import UserError, require
from vime.models.draft_format import FLAG, WEIGHTS, ExternalFormat, shape_for_target
from vime.models.draft_kind import DraftKind, DraftKnobs

NUM_AUX = 3  # vLLM's eagle3 fc reads three aux hidden states unless the config says otherwise


def vllm_default_aux_layer_ids(num_target_layers):
    """vLLM's default aux layers (get_eagle3_default_aux_hidden_state_layers), deduplicated as it does."""
    n = num_target_layers
    return tuple(sorted({2, n // 2, n - 3}))


def default_aux_layer_ids(num_target_layers):
    """The aux layers a new draft reads: vLLM's default where it names three distinct layers (a target
    of 7 layers or more), else the embedding output, the middle and the last layer's output."""
    ids = vllm_default_aux_layer_ids(num_target_layers)
    return ids if len(ids) == NUM_AUX else tuple(sorted({0, num_target_layers // 2, num_target_layers}))


def draft_config_for_target(target_cfg, intermediate_size=None, aux_layer_ids=None, draft_vocab_size=None):
    """An Eagle3Config shaped for `target_cfg` (a ModelConfig): its hidden size, heads and vocabulary (the
    target's whole vocabulary, or `draft_vocab_size` tokens of it)."""
    layers = target_cfg.num_hidden_layers
    ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(layers)
    require(len(ids) == NUM_AUX and len(set(ids)) == NUM_AUX and all(0 <= i <= layers for i in ids),
            f"EAGLE-3 needs {NUM_AUX} distinct aux layers in [0, {layers}] of the target (got {list(ids)}); "
            "a target needs at least 2 layers")
    vocab = target_cfg.vocab_size
    return Eagle3Config(**shape_for_target(target_cfg, intermediate_size), aux_layer_ids=tuple(sorted(ids)),
                        draft_vocab_size=draft_vocab_size if draft_vocab_size not in (None, vocab) else None)


def _to_hf(cfg):
    return {"model_type": "llama", "num_hidden_layers": 1, "draft_vocab_size": cfg.head_size,
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids)}


def _draft_vocab_size(raw, vocab_size, path):
    """config.json's draft_vocab_size as the config holds it: None for the target's whole vocabulary."""
    n = raw.get("draft_vocab_size")
    if n is None:
        return None
    require(type(n) is int and 1 <= n <= vocab_size,
            f"{FLAG}: draft {path} has draft_vocab_size {n!r} in config.json but vocab_size {vocab_size}; a draft "
            f"predicts from 1 to vocab_size of the target's tokens")
    return n if n < vocab_size else None


def _from_hf(raw, shape, path):
    require(raw.get("num_hidden_layers", 1) == 1,
            f"{FLAG}: draft {path} has num_hidden_layers {raw.get('num_hidden_layers')}; vime's EAGLE-3 draft has one")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(**shape, aux_layer_ids=tuple(ids) if ids else None,
                        draft_vocab_size=_draft_vocab_size(raw, shape["vocab_size"], path))


def _check_vocabulary(where, cfg, read):
    """A reduced vocabulary's tables: d2t maps the draft ids onto distinct target ids inside the target's
    vocabulary, and t2d marks exactly those (`read(name)`: a tensor of the draft's)."""
    if not cfg.reduced_vocab:
        return
    import torch

    d2t, t2d = read("d2t"), read("t2d")
    fix = f"({WEIGHTS}); make the draft again with {EAGLE3.format.make}"
    if d2t.is_floating_point() or t2d.dtype != torch.bool:
        raise UserError(f"{where}: d2t holds {d2t.dtype} and t2d {t2d.dtype}, not integer offsets and booleans {fix}")
    targets = torch.arange(len(d2t)) + d2t.long()
    outside = ((targets < 0) | (targets >= cfg.vocab_size)).nonzero().flatten().tolist()
    if outside:
        raise UserError(f"{where}: d2t maps draft id {outside[0]} to target id {int(targets[outside[0]])}, outside "
                        f"vocab_size {cfg.vocab_size} {fix}")
    values, counts = targets.unique(return_counts=True)
    if (counts > 1).any():
        raise UserError(f"{where}: d2t maps {int(counts.max())} draft ids to target id "
                        f"{int(values[counts > 1][0])}; each target id is at most one draft id {fix}")
    marked = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    marked[targets] = True
    differ = (marked != t2d).nonzero().flatten().tolist()
    if differ:
        raise UserError(f"{where}: t2d disagrees with d2t at target id {differ[0]} (t2d marks {int(t2d.sum())} "
                        f"target ids, d2t names {len(targets)}) {fix}")


def resolve_aux_layers(draft_cfg, target_cfg):
    """The draft's config with its aux layer ids filled in as vLLM picks them for this target."""
    ids = draft_cfg.aux_layer_ids or vllm_default_aux_layer_ids(target_cfg.num_hidden_layers)
    return dataclasses.replace(draft_cfg, aux_layer_ids=tuple(sorted(ids)))


def _fits(path, cfg, target_cfg, num_speculative_tokens):
    ids = cfg.aux_layer_ids
    require(len(ids) == NUM_AUX and len(set(ids)) == NUM_AUX and all(0 <= i <= target_cfg.num_hidden_layers for i in ids),
            f"{FLAG}: draft {path} reads aux layers {list(ids)} but the target has "
            f"{target_cfg.num_hidden_layers} layers (EAGLE-3 reads {NUM_AUX} distinct ones)")


EAGLE3 = DraftKind(
    name="eagle3", title="EAGLE-3", proposer="Eagle3Proposer", trainer="Eagle3DraftTrainer",
    # a small module of its own: many cheap steps on the updated policy's states keep it caught up
    knobs=DraftKnobs(lr=1e-3, steps_per_rollout=8, replay_batches=4),
    legacy_state_file="eagle3_draft.pt",
    format=ExternalFormat(
        architecture="LlamaForCausalLMEagle3", model=Eagle3Draft, to_hf=_to_hf, from_hf=_from_hf,
        layer_ids_key="eagle_aux_hidden_state_layer_ids", make="scripts/make_eagle3_draft.py", fits=_fits,
        for_target=resolve_aux_layers, check_values=_check_vocabulary,
        tensor_keys={"lm_head": "draft_vocab_size, hidden_size", "d2t": "draft_vocab_size",
                     "t2d": "vocab_size, draft_vocab_size"},
        # vLLM numbers the draft's one layer after the target's L layers; embed_tokens is the target's
        vllm_names=((r"model\.layers\.{L}\.", "midlayer."), (r"model\.fc\.", "fc."), (r"model\.norm\.", "norm."),
                    (r"lm_head\.", "lm_head."))),
)
