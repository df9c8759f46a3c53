"""The DSpark draft's checkpoint format: vLLM's `Qwen3DSparkModel` directory (pure).

A DFlash draft directory (vime/models/dflash.py) with DSpark's keys and heads. config.json: a Qwen3
config of the draft's own layers with `architectures` ["Qwen3DSparkModel"], `block_size` (the
block's slots, each drafting one token: vLLM's num_speculative_tokens), `target_layer_ids` (target
layers whose OUTPUT the draft reads, 0 = the first, the Qwen3 DSpark key vLLM reads),
`dspark_noise_token_id` (the token the block's slots after the anchor hold), `markov_rank`,
`enable_confidence_head`, `confidence_head_with_markov` and `sample_from_anchor` true (the anchor
slot drafts the next token). model.safetensors: DFlash's tensors plus `markov_head.markov_w1.weight`
[V, r], `markov_head.markov_w2.weight` [V, r] and, with the confidence head,
`confidence_head.proj.{weight,bias}`; no `embed_tokens` and no `lm_head` (vLLM shares the target's).
That is what `vllm.LLM(speculative_config={"method": "dspark", "model": DIR})` loads on a GPU build
(vLLM drafts DSpark only in its GPU model runner).
"""
from mtp.dspark import DSparkConfig
from vime.errors import UserError, require
from vime.models import dflash
from vime.models.draft_dir import read_draft_json, read_draft_tensors, write_draft_dir
from vime.models.families import DSPARK_PREFIX

ARCHITECTURE = "Qwen3DSparkModel"
FLAG = "--vllm-speculative-config"
MAKE = "`python scripts/make_dspark_draft.py --target CKPT --out DIR`"
WIRE_PREFIX = DSPARK_PREFIX  # the draft's tensors on the weight-sync wire
REQUIRED_TENSORS = dflash.REQUIRED_TENSORS + ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
CONFIDENCE_TENSORS = ("confidence_head.proj.weight", "confidence_head.proj.bias")


def draft_config_for_target(target_cfg, num_layers, block_size, markov_rank=32, confidence_head=True,
                            confidence_head_with_markov=False, target_layer_ids=None, noise_token_id=None,
                            intermediate_size=None):
    """A DSparkConfig shaped for `target_cfg` (a ModelConfig); the noise token defaults to its pad token."""
    base = dflash.draft_config_for_target(target_cfg, num_layers, block_size, target_layer_ids, noise_token_id,
                                          intermediate_size)
    return DSparkConfig(**vars(base), markov_rank=markov_rank, enable_confidence_head=confidence_head,
                        confidence_head_with_markov=confidence_head_with_markov)


def to_hf_dict(cfg):
    """config.json of a draft vLLM loads as Qwen3DSparkModel."""
    raw = {k: v for k, v in dflash.to_hf_dict(cfg).items() if k != "dflash_config"}
    raw.update(architectures=[ARCHITECTURE], target_layer_ids=list(cfg.target_layer_ids),
               dspark_noise_token_id=cfg.mask_token_id, markov_rank=cfg.markov_rank,
               enable_confidence_head=cfg.enable_confidence_head,
               confidence_head_with_markov=cfg.confidence_head_with_markov, sample_from_anchor=True)
    return raw


def _not_a_draft(path, why):
    return UserError(f"{FLAG}: model {path} is not a DSpark draft ({why}); make one with {MAKE}")


def read_draft_config(path):
    """DSparkConfig of a draft directory; one line naming the directory when it is not a draft."""
    raw = read_draft_json(path, _not_a_draft, ARCHITECTURE)
    try:
        heads = raw["num_attention_heads"]
        return DSparkConfig(
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, vocab_size=raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size") or raw["hidden_size"],
            target_layer_ids=tuple(raw["target_layer_ids"]), mask_token_id=raw["dspark_noise_token_id"],
            block_size=raw["block_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=(raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 10000.0)),
            max_position_embeddings=raw.get("max_position_embeddings", 256), markov_rank=raw["markov_rank"],
            enable_confidence_head=bool(raw.get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(raw.get("confidence_head_with_markov", False)))
    except KeyError as e:
        raise _not_a_draft(path, f"config.json lacks {e.args[0]!r}") from None
    except TypeError:
        raise _not_a_draft(path, "target_layer_ids must be a list of layer indices") from None


def check_draft_fits_target(path, draft_cfg, target_cfg, num_speculative_tokens=None):
    """DFlash's checks of the backbone (aux states, width, vocabulary, target layers, noise token),
    then the block: num_speculative_tokens must be the draft's block_size (one line each)."""
    require(isinstance(draft_cfg.block_size, int) and draft_cfg.block_size >= 1,
            f"{FLAG}: draft {path} has block_size {draft_cfg.block_size}; a DSpark draft's config.json gives an "
            "integer block_size >= 1 (its drafts per block)")
    dflash.check_backbone_fits_target(path, draft_cfg, target_cfg, "dspark", "DSpark", MAKE, "dspark_noise_token_id")
    require(isinstance(draft_cfg.markov_rank, int) and draft_cfg.markov_rank >= 1,
            f"{FLAG}: draft {path} has markov_rank {draft_cfg.markov_rank}; a DSpark draft's Markov head has "
            "an integer rank >= 1")
    size = draft_cfg.block_size
    require(num_speculative_tokens is None or num_speculative_tokens == size,
            f"{FLAG}: num_speculative_tokens {num_speculative_tokens} does not fit draft {path}, built for "
            f"blocks of {size} (num_speculative_tokens {size}); its attention inside a block is not causal, "
            f"so it drafts exactly that many (make another with {MAKE} --block-size N)")


def save_draft(path, cfg, state):
    """Write a draft directory (config.json + model.safetensors) vLLM serves unchanged."""
    write_draft_dir(path, to_hf_dict(cfg), state)


def load_draft(path):
    """(DSparkConfig, state dict) of a draft directory."""
    cfg = read_draft_config(path)
    required = REQUIRED_TENSORS + (CONFIDENCE_TENSORS if cfg.enable_confidence_head else ())
    state = read_draft_tensors(path, _not_a_draft, required)
    own = [n for n in ("embed_tokens.weight", "lm_head.weight") if n in state]
    require(not own, f"{FLAG}: draft {path} stores its own {own[0] if own else ''}; vime's DSpark draft reads the "
            "target's embedding and head (remove the tensor from model.safetensors)")
    return cfg, state
