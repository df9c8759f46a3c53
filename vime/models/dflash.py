"""The DFlash kind (pure): its descriptor, and its part of the external-draft format, vLLM's
`DFlashDraftModel` directory.

config.json is a Qwen3 config of the draft's own layers, with `dflash_config` = {`target_layer_ids`,
`mask_token_id`, `block_size`} (`block_size` also at the top level, as DFlash's own checkpoints write
it); model.safetensors holds the tensors of mtp/dflash.py under the names vLLM's `qwen3_dflash.py`
loads: `fc`, `hidden_norm`, `layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj,
self_attn.{q,k}_norm, post_attention_layernorm, mlp.*}`, `norm`. No `embed_tokens` and no `lm_head`:
vLLM shares the target's with a draft that stores none, and the embedded engine reads the target's
too. That is what `vllm.LLM(speculative_config={"method": "dflash", "model": DIR})` loads unchanged.

Numbering: `target_layer_ids` name target layers whose OUTPUT the draft reads (0 = the first
layer); vLLM adds one to get its aux-hidden-state ids (id i: the residual stream after i layers).
The block: `block_size` = 1 + the number of drafts; attention is not causal inside the block,
so a draft only drafts the block it was trained for (num_speculative_tokens = block_size - 1).
"""
import json

from mtp.dflash import DFlashConfig, DFlashDraft
from vime.errors import require
from vime.models.hf_format import json_kind
from vime.models.draft_format import FLAG, ExternalFormat, shape_for_target
from vime.models.draft_kind import DraftKind, DraftKnobs

MAKE = "scripts/make_dflash_draft.py"


def default_target_layer_ids(num_target_layers, count=3):
    """`count` target layers spread evenly from the second to the second-to-last (1, 3, 5 of 7)."""
    last = max(1, num_target_layers - 2)
    if count == 1:
        return (num_target_layers // 2,)
    return tuple(sorted({round(1 + i * (last - 1) / (count - 1)) for i in range(count)}))


def draft_config_for_target(target_cfg, num_layers, block_size, target_layer_ids=None, mask_token_id=None,
                            intermediate_size=None):
    """A DFlashConfig shaped for `target_cfg` (a ModelConfig): its hidden size, heads and vocabulary;
    the mask token defaults to the target's pad token."""
    ids = tuple(sorted(target_layer_ids)) if target_layer_ids is not None else \
        default_target_layer_ids(target_cfg.num_hidden_layers)
    mask = mask_token_id if mask_token_id is not None else target_cfg.pad_token_id
    require(mask is not None, "the target has no pad_token_id to use as the DFlash mask token: pass --mask-token-id")
    return DFlashConfig(**shape_for_target(target_cfg, intermediate_size), num_hidden_layers=num_layers,
                        target_layer_ids=ids, mask_token_id=mask, block_size=block_size)


def _to_hf(cfg):
    return {"model_type": "qwen3", "num_hidden_layers": cfg.num_hidden_layers, "block_size": cfg.block_size,
            "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id,
                              "block_size": cfg.block_size}}


def _from_hf(raw, shape, path):
    dflash = raw.get("dflash_config") or {}
    top, inner = raw.get("block_size"), dflash.get("block_size")
    require(top is None or inner is None or top == inner,
            f"{FLAG}: draft {path} gives block_size {top} and dflash_config.block_size {inner}; vLLM reads the "
            "latter: make them equal in config.json (the block the draft was trained for)")
    ids = dflash["target_layer_ids"]
    require(isinstance(ids, list), f"{FLAG}: draft {path}: dflash_config.target_layer_ids must be a list of layer "
            f"indices (got {ids!r})")
    return DFlashConfig(**shape, num_hidden_layers=raw["num_hidden_layers"], target_layer_ids=tuple(ids),
                        mask_token_id=dflash["mask_token_id"], block_size=inner if inner is not None else top)


def check_backbone_fits(path, cfg, target_cfg, token_key="mask_token_id"):
    """A block draft's target layers and the token its block's slots after the anchor hold (`token_key`
    in its config.json) fit the target (one line each)."""
    ids, layers = list(cfg.target_layer_ids), target_cfg.num_hidden_layers
    require(ids and all(_is_int(i) and 0 <= i < layers for i in ids) and ids == sorted(set(ids)),
            f"{FLAG}: draft {path} reads target_layer_ids {json.dumps(ids)} but the target has {layers} layers "
            f"(give distinct increasing integer ids in [0, {layers - 1}])")
    mask = cfg.mask_token_id
    require(_is_int(mask) and 0 <= mask < target_cfg.vocab_size,
            f"{FLAG}: draft {path}: its {token_key} is {json_kind(mask)}, not a token of the target's vocabulary "
            f"[0, {target_cfg.vocab_size}); its block slots are embedded with the target's embedding")


def _is_int(value):
    """An integer as JSON means it (true and false are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _fits(path, cfg, target_cfg, num_speculative_tokens):
    """The draft's target layers, mask token and block fit the target and the drafts asked for."""
    check_backbone_fits(path, cfg, target_cfg)
    size = cfg.block_size
    require(_is_int(size) and size >= 2,
            f"{FLAG}: draft {path}: its config.json's block_size is {json_kind(size)}; a DFlash draft's block_size "
            "is an integer >= 2 (the anchor plus its drafts)")
    require(num_speculative_tokens is None or num_speculative_tokens == size - 1,
            f"{FLAG}: num_speculative_tokens {num_speculative_tokens} does not fit draft {path}, built for "
            f"blocks of {size} (num_speculative_tokens {size - 1}); its attention inside a block is not causal, "
            f"so it drafts exactly that many (make another with `python {MAKE} --target CKPT --out DIR --block-size N`)")


DFLASH = DraftKind(
    name="dflash", title="DFlash", proposer="DFlashProposer", trainer="DFlashDraftTrainer", block=True,
    # one forward trains every anchor's whole block, so few anchors per sequence suffice on short
    # responses; like EAGLE-3 a small module that many cheap steps on the updated policy keep caught up
    knobs=DraftKnobs(lr=1e-3, steps_per_rollout=8, replay_batches=4),
    format=ExternalFormat(
        architecture="DFlashDraftModel", model=DFlashDraft, to_hf=_to_hf, from_hf=_from_hf,
        layer_ids_key="dflash_config.target_layer_ids", make=MAKE, fits=_fits,
        reads_from_target=("embed_tokens.weight", "lm_head.weight"),
        config_hint="dflash_config holds target_layer_ids and mask_token_id",
        # vLLM numbers the draft's layers after the target's L; embed_tokens and lm_head are the target's
        vllm_names=((r"model\.layers\.(\d+)\.", "layers.{}."), (r"model\.fc\.", "fc."),
                    (r"model\.hidden_norm\.", "hidden_norm."), (r"model\.norm\.", "norm."))),
)
