"""The DSpark kind (pure): its descriptor, and its part of the external-draft format, vLLM's
`Qwen3DSparkModel` directory.

A DFlash draft (vime/models/dflash.py) with DSpark's keys and heads. config.json: a Qwen3 config of the
draft's own layers with `block_size` (the block's slots, each drafting one token: vLLM's
num_speculative_tokens), `target_layer_ids` (target layers whose OUTPUT the draft reads, 0 = the
first: the Qwen3 DSpark key vLLM reads), `dspark_noise_token_id` (the token of the block's slots after
the anchor), `markov_rank`, `enable_confidence_head`, `confidence_head_with_markov` and
`sample_from_anchor` true (the anchor's slot drafts the next token). model.safetensors: DFlash's
tensors plus `markov_head.markov_w1.weight` [V, r], `markov_head.markov_w2.weight` [V, r] and, with the
confidence head, `confidence_head.proj.{weight,bias}`; no `embed_tokens` and no `lm_head` (vLLM shares
the target's). That is what `vllm.LLM(speculative_config={"method": "dspark", "model": DIR})` loads on
a GPU build: vLLM 0.32 drafts DSpark only in its GPU model runner.
"""
from mtp.dspark import RECIPE_WEIGHTS, DSparkConfig, DSparkDraft
from vime.errors import require
from vime.models.hf_format import json_kind
from vime.models import dflash
from vime.models.draft_format import FLAG, ExternalFormat
from vime.models.draft_kind import DraftKind

MAKE = "scripts/make_dspark_draft.py"


def draft_config_for_target(target_cfg, num_layers, block_size, markov_rank=32, confidence_head=True,
                            confidence_head_with_markov=False, target_layer_ids=None, noise_token_id=None,
                            intermediate_size=None):
    """A DSparkConfig shaped for `target_cfg` (a ModelConfig); the noise token defaults to its pad token."""
    base = dflash.draft_config_for_target(target_cfg, num_layers, block_size, target_layer_ids, noise_token_id,
                                          intermediate_size)
    return DSparkConfig(**vars(base), markov_rank=markov_rank, enable_confidence_head=confidence_head,
                        confidence_head_with_markov=confidence_head_with_markov)


def _to_hf(cfg):
    return {"model_type": "qwen3", "num_hidden_layers": cfg.num_hidden_layers, "block_size": cfg.block_size,
            "target_layer_ids": list(cfg.target_layer_ids), "dspark_noise_token_id": cfg.mask_token_id,
            "markov_rank": cfg.markov_rank, "enable_confidence_head": cfg.enable_confidence_head,
            "confidence_head_with_markov": cfg.confidence_head_with_markov, "sample_from_anchor": True}


def _from_hf(raw, shape, path):
    ids = raw["target_layer_ids"]
    require(isinstance(ids, list), f"{FLAG}: draft {path}: target_layer_ids must be a list of layer indices "
            f"(got {ids!r})")
    require(raw.get("sample_from_anchor", True) is True,
            f"{FLAG}: draft {path} has sample_from_anchor {raw.get('sample_from_anchor')!r}; vime drafts DSpark as "
            "vLLM does by default, every slot of the block (the anchor's too) drafting the token after it")
    return DSparkConfig(**shape, num_hidden_layers=raw["num_hidden_layers"], target_layer_ids=tuple(ids),
                        mask_token_id=raw["dspark_noise_token_id"], block_size=raw["block_size"],
                        markov_rank=raw["markov_rank"], enable_confidence_head=bool(raw.get("enable_confidence_head")),
                        confidence_head_with_markov=bool(raw.get("confidence_head_with_markov")))


def _fits(path, cfg, target_cfg, num_speculative_tokens):
    """The backbone's target layers and noise token fit the target, the Markov head has a rank, and the
    block is the drafts asked for."""
    dflash.check_backbone_fits(path, cfg, target_cfg, "dspark_noise_token_id")
    require(dflash._is_int(cfg.markov_rank) and cfg.markov_rank >= 1,
            f"{FLAG}: draft {path}: its config.json's markov_rank is {json_kind(cfg.markov_rank)}; its Markov head "
            "needs an integer rank >= 1")
    size = cfg.block_size
    require(dflash._is_int(size) and size >= 1,
            f"{FLAG}: draft {path}: its config.json's block_size is {json_kind(size)}; a DSpark draft's block_size "
            "is an integer >= 1 (its drafts per block)")
    require(num_speculative_tokens is None or num_speculative_tokens == size,
            f"{FLAG}: num_speculative_tokens {num_speculative_tokens} does not fit draft {path}, built for blocks of "
            f"{size} (num_speculative_tokens {size}); its attention inside a block is not causal, so it drafts exactly "
            f"that many (make another with `python {MAKE} --target CKPT --out DIR --block-size N`)")


DSPARK = DraftKind(
    name="dspark", title="DSpark", proposer="DSparkProposer", trainer="DSparkDraftTrainer", block=True,
    anchor_drafts=True, confidence=True, loss_weights=tuple(RECIPE_WEIGHTS.items()), vllm_gpu_runner_only=True,
    knobs=dflash.DFLASH.knobs,  # the DFlash backbone's, which most of its parameters are
    format=ExternalFormat(
        architecture="Qwen3DSparkModel", model=DSparkDraft, to_hf=_to_hf, from_hf=_from_hf,
        layer_ids_key="target_layer_ids", make=MAKE, fits=_fits,
        reads_from_target=("embed_tokens.weight", "lm_head.weight"),
        config_hint="target_layer_ids, dspark_noise_token_id and markov_rank are top-level keys",
        tensor_keys={"markov_w1": "vocab_size, markov_rank", "markov_w2": "vocab_size, markov_rank",
                     "proj": "hidden_size, markov_rank, enable_confidence_head, confidence_head_with_markov"},
        # vLLM numbers the draft's layers after the target's L, and keeps its heads under model.
        vllm_names=dflash.DFLASH.format.vllm_names + ((r"model\.markov_head\.", "markov_head."),
                                                      (r"model\.confidence_head\.", "confidence_head."))),
)
