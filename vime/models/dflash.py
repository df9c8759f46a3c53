"""The DFlash draft's checkpoint format: vLLM's `DFlashDraftModel` directory (pure).

A draft directory holds `config.json` (a Qwen3 config of the draft's own layers, with
`dflash_config` = {`target_layer_ids`, `mask_token_id`, `block_size`}, `block_size` also at the
top level as DFlash's own checkpoints write it) and `model.safetensors` with the tensors of
mtp/dflash.py under the names vLLM's `qwen3_dflash.py` loads: `fc`, `hidden_norm`,
`layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.*}`, `norm`. No `embed_tokens` and no `lm_head`: vLLM shares the
target's with a draft that stores none, and the embedded engine reads the target's too.
That is what `vllm.LLM(speculative_config={"method": "dflash", "model": DIR})` loads unchanged.

Numbering: `target_layer_ids` name target layers whose OUTPUT the draft reads (0 = the first
layer); vLLM adds one to get its aux-hidden-state ids (id i: the residual stream after i layers).
The block: `block_size` = 1 + the number of drafts; attention is not causal inside the block,
so a draft only drafts the block it was trained for (num_speculative_tokens = block_size - 1).
"""
from mtp.dflash import DFlashConfig
from vime.errors import UserError, require
from vime.models.draft_dir import (check_target_gives_what_drafts_read, read_draft_json, read_draft_tensors,
                                   write_draft_dir)
from vime.models.families import DFLASH_PREFIX

ARCHITECTURE = "DFlashDraftModel"
FLAG = "--vllm-speculative-config"
MAKE = "`python scripts/make_dflash_draft.py --target CKPT --out DIR`"
WIRE_PREFIX = DFLASH_PREFIX  # the draft's tensors on the weight-sync wire
REQUIRED_TENSORS = ("fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight")


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
    return DFlashConfig(
        hidden_size=target_cfg.hidden_size, intermediate_size=intermediate_size or target_cfg.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=target_cfg.num_attention_heads,
        num_key_value_heads=target_cfg.num_key_value_heads, head_dim=target_cfg.head_dim,
        vocab_size=target_cfg.vocab_size, target_hidden_size=target_cfg.hidden_size, target_layer_ids=ids,
        mask_token_id=mask, block_size=block_size, rms_norm_eps=target_cfg.rms_norm_eps,
        rope_theta=target_cfg.rope_theta, max_position_embeddings=target_cfg.max_position_embeddings)


def to_hf_dict(cfg):
    """config.json of a draft vLLM loads as DFlashDraftModel."""
    return {
        "architectures": [ARCHITECTURE], "model_type": "qwen3", "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "block_size": cfg.block_size,
        "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id,
                          "block_size": cfg.block_size},
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32",
    }


def _not_a_draft(path, why):
    return UserError(f"{FLAG}: model {path} is not a DFlash draft ({why}); make one with {MAKE}")


def read_draft_config(path):
    """DFlashConfig of a draft directory; one line naming the directory when it is not a draft."""
    raw = read_draft_json(path, _not_a_draft, ARCHITECTURE)
    dflash = raw.get("dflash_config") or {}
    both = (raw.get("block_size"), dflash.get("block_size"))
    require(None in both or both[0] == both[1],
            f"{FLAG}: draft {path} gives block_size {both[0]} and dflash_config.block_size {both[1]}; vLLM reads the "
            "latter: make them equal in config.json (the block the draft was trained for)")
    try:
        heads = raw["num_attention_heads"]
        ids = dflash["target_layer_ids"]
        mask = dflash["mask_token_id"]
        return DFlashConfig(
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, vocab_size=raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size") or raw["hidden_size"],
            target_layer_ids=tuple(ids), mask_token_id=mask,
            block_size=dflash.get("block_size", raw.get("block_size")), rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=(raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 10000.0)),
            max_position_embeddings=raw.get("max_position_embeddings", 256))
    except KeyError as e:
        raise _not_a_draft(path, f"config.json lacks {e.args[0]!r} (dflash_config holds target_layer_ids "
                                 "and mask_token_id)") from None
    except TypeError:
        raise _not_a_draft(path, "dflash_config.target_layer_ids must be a list of layer indices") from None


def check_backbone_fits_target(path, draft_cfg, target_cfg, method="dflash", kind="DFlash", make=MAKE,
                               token_key="mask_token_id"):
    """The target's family gives aux hidden states, and a block draft's width, vocabulary, target layers
    and the token its block slots hold (`token_key`) fit the target (one line each)."""
    check_target_gives_what_drafts_read(path, draft_cfg, target_cfg, method, kind, make)
    ids, layers = list(draft_cfg.target_layer_ids), target_cfg.num_hidden_layers
    require(ids and all(isinstance(i, int) and 0 <= i < layers for i in ids) and ids == sorted(set(ids)),
            f"{FLAG}: draft {path} reads target_layer_ids {ids} but the target has {layers} layers "
            f"(give distinct increasing ids in [0, {layers - 1}])")
    mask = draft_cfg.mask_token_id
    require(isinstance(mask, int) and 0 <= mask < target_cfg.vocab_size,
            f"{FLAG}: draft {path} has {token_key} {mask}, not a token of the target's vocabulary "
            f"[0, {target_cfg.vocab_size}); its block slots are embedded with the target's embedding")


def check_draft_fits_target(path, draft_cfg, target_cfg, num_speculative_tokens=None):
    """The backbone fits the target (`check_backbone_fits_target`) and the block the requested drafts."""
    check_backbone_fits_target(path, draft_cfg, target_cfg)
    size = draft_cfg.block_size
    require(isinstance(size, int) and size >= 2,
            f"{FLAG}: draft {path} has block_size {size}; a DFlash draft's config.json gives an integer "
            "block_size >= 2 (the anchor plus its drafts)")
    require(num_speculative_tokens is None or num_speculative_tokens == size - 1,
            f"{FLAG}: num_speculative_tokens {num_speculative_tokens} does not fit draft {path}, built for "
            f"blocks of {size} (num_speculative_tokens {size - 1}); its attention inside a block is not causal, "
            f"so it drafts exactly that many (make another with {MAKE} --block-size N)")


def save_draft(path, cfg, state):
    """Write a draft directory (config.json + model.safetensors) vLLM serves unchanged."""
    write_draft_dir(path, to_hf_dict(cfg), state)


def load_draft(path):
    """(DFlashConfig, state dict) of a draft directory."""
    cfg = read_draft_config(path)
    state = read_draft_tensors(path, _not_a_draft, REQUIRED_TENSORS)
    own = [n for n in ("embed_tokens.weight", "lm_head.weight") if n in state]
    require(not own, f"{FLAG}: draft {path} stores its own {own[0] if own else ''}; vime's DFlash draft reads the "
            "target's embedding and head (remove the tensor from model.safetensors)")
    return cfg, state
