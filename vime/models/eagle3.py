"""The EAGLE-3 kind (pure): its descriptor, and its part of the external-draft format, vLLM's
`LlamaForCausalLMEagle3` directory.

config.json is a Llama config with one decoder layer, `draft_vocab_size`, `target_hidden_size` and
`eagle_aux_hidden_state_layer_ids`; model.safetensors holds the tensors of mtp/eagle3.py under the
names vLLM's `llama_eagle3.py` loads (no `embed_tokens`: the draft reads the target's, as vLLM shares
it with a draft that stores none). That is what `vllm.LLM(speculative_config={"method": "eagle3",
"model": DIR})` loads unchanged.

Which target layers feed the draft: the ids written in config.json (vLLM reads
`eagle_aux_hidden_state_layer_ids` from the draft's config first), else vLLM's own choice
(2, L // 2, L - 3) for an L-layer target. Id i is the residual stream before target layer i. A new
draft for a target too shallow for vLLM's choice (fewer than 7 layers: the tiny GLM-4.5 and
DeepSeek-V3 models) reads the embedding output, the middle and the last layer's output.
"""
import dataclasses

from mtp.eagle3 import Eagle3Config, Eagle3Draft
from vime.errors import require
from vime.models.draft_format import FLAG, ExternalFormat, shape_for_target
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


def draft_config_for_target(target_cfg, intermediate_size=None, aux_layer_ids=None):
    """An Eagle3Config shaped for `target_cfg` (a ModelConfig): its hidden size, heads and vocabulary."""
    layers = target_cfg.num_hidden_layers
    ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(layers)
    require(len(ids) == NUM_AUX and len(set(ids)) == NUM_AUX and all(0 <= i <= layers for i in ids),
            f"EAGLE-3 needs {NUM_AUX} distinct aux layers in [0, {layers}] of the target (got {list(ids)}); "
            "a target needs at least 2 layers")
    return Eagle3Config(**shape_for_target(target_cfg, intermediate_size), aux_layer_ids=tuple(sorted(ids)))


def _to_hf(cfg):
    return {"model_type": "llama", "num_hidden_layers": 1, "draft_vocab_size": cfg.vocab_size,
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids)}


def _from_hf(raw, shape, path):
    require(raw.get("num_hidden_layers", 1) == 1,
            f"{FLAG}: draft {path} has num_hidden_layers {raw.get('num_hidden_layers')}; vime's EAGLE-3 draft has one")
    draft_vocab = raw.get("draft_vocab_size") or raw.get("vocab_size")
    require(draft_vocab == raw.get("vocab_size"),
            f"{FLAG}: draft {path} has draft_vocab_size {draft_vocab} != vocab_size {raw.get('vocab_size')}; "
            "vime's EAGLE-3 draft predicts the target's whole vocabulary (no d2t table)")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(**shape, aux_layer_ids=tuple(ids) if ids else None)


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
        for_target=resolve_aux_layers,
        # vLLM numbers the draft's one layer after the target's L layers; embed_tokens is the target's
        vllm_names=((r"model\.layers\.{L}\.", "midlayer."), (r"model\.fc\.", "fc."), (r"model\.norm\.", "norm."),
                    (r"lm_head\.", "lm_head."))),
)
