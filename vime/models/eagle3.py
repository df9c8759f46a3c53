"""The EAGLE-3 draft's checkpoint format: vLLM's `LlamaForCausalLMEagle3` directory (pure).

A draft directory holds `config.json` (a Llama config with one decoder layer, `draft_vocab_size`,
`target_hidden_size` and `eagle_aux_hidden_state_layer_ids`) and `model.safetensors` with the
tensors of mtp/eagle3.py under the names vLLM's `llama_eagle3.py` loads (no `embed_tokens`: the
draft reads the target's embedding, as vLLM shares it with a draft that stores none). That is
what `vllm.LLM(speculative_config={"method": "eagle3", "model": DIR})` loads unchanged.

Which target layers feed the draft: the ids written in config.json (vLLM reads
`eagle_aux_hidden_state_layer_ids` from the draft's config first), by default vLLM's own choice
(2, L // 2, L - 3) for an L-layer target. Id i is the residual stream before target layer i.
"""
from mtp.eagle3 import Eagle3Config
from vime.errors import UserError, require
from vime.models.draft_dir import (check_target_gives_what_drafts_read, read_draft_json, read_draft_tensors,
                                   write_draft_dir)

ARCHITECTURE = "LlamaForCausalLMEagle3"
NUM_AUX = 3  # vLLM's eagle3 fc reads three aux hidden states unless the config says otherwise
FLAG = "--vllm-speculative-config"


def default_aux_layer_ids(num_target_layers):
    """vLLM's default aux layers (get_eagle3_default_aux_hidden_state_layers), deduplicated as it does."""
    n = num_target_layers
    return tuple(sorted({2, n // 2, n - 3}))


def draft_config_for_target(target_cfg, intermediate_size=None, aux_layer_ids=None):
    """An Eagle3Config shaped for `target_cfg` (a ModelConfig): its hidden size, heads and vocabulary."""
    ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(target_cfg.num_hidden_layers)
    require(len(ids) == NUM_AUX and len(set(ids)) == NUM_AUX and all(0 <= i <= target_cfg.num_hidden_layers for i in ids),
            f"EAGLE-3 needs {NUM_AUX} distinct aux layers in [0, {target_cfg.num_hidden_layers}] of the target "
            f"(got {list(ids)}); a target needs at least 7 layers for vLLM's default choice")
    return Eagle3Config(
        hidden_size=target_cfg.hidden_size, intermediate_size=intermediate_size or target_cfg.intermediate_size,
        num_attention_heads=target_cfg.num_attention_heads, num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=target_cfg.head_dim, vocab_size=target_cfg.vocab_size, target_hidden_size=target_cfg.hidden_size,
        aux_layer_ids=tuple(sorted(ids)), rms_norm_eps=target_cfg.rms_norm_eps, rope_theta=target_cfg.rope_theta,
        max_position_embeddings=target_cfg.max_position_embeddings)


def to_hf_dict(cfg):
    """config.json of a draft vLLM loads as LlamaForCausalLMEagle3."""
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32",
    }


def _not_a_draft(path, why):
    return UserError(f"{FLAG}: model {path} is not an EAGLE-3 draft ({why}); make one with "
                     "`python scripts/make_eagle3_draft.py --target CKPT --out DIR`")


def read_draft_config(path):
    """Eagle3Config of a draft directory; one line naming the directory when it is not a draft."""
    raw = read_draft_json(path, _not_a_draft, ARCHITECTURE)
    require(raw.get("num_hidden_layers", 1) == 1,
            f"{FLAG}: draft {path} has num_hidden_layers {raw.get('num_hidden_layers')}; vime's EAGLE-3 draft has one")
    draft_vocab = raw.get("draft_vocab_size") or raw.get("vocab_size")
    require(draft_vocab == raw.get("vocab_size"),
            f"{FLAG}: draft {path} has draft_vocab_size {draft_vocab} != vocab_size {raw.get('vocab_size')}; "
            "vime's EAGLE-3 draft predicts the target's whole vocabulary (no d2t table)")
    try:
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        heads = raw["num_attention_heads"]
        return Eagle3Config(
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"], num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, vocab_size=raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size", raw["hidden_size"]),
            aux_layer_ids=tuple(ids) if ids else None, rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=(raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 10000.0)),
            max_position_embeddings=raw.get("max_position_embeddings", 256))
    except KeyError as e:
        raise _not_a_draft(path, f"config.json lacks {e.args[0]!r}") from None


def resolve_aux_layers(draft_cfg, target_cfg):
    """The draft's config with its aux layer ids filled in as vLLM picks them for this target."""
    import dataclasses

    ids = draft_cfg.aux_layer_ids or default_aux_layer_ids(target_cfg.num_hidden_layers)
    return dataclasses.replace(draft_cfg, aux_layer_ids=tuple(sorted(ids)))


def check_draft_fits_target(path, draft_cfg, target_cfg):
    """The target's family gives aux hidden states and the draft's shapes fit the target (one line each)."""
    check_target_gives_what_drafts_read(path, draft_cfg, target_cfg, "eagle3", "EAGLE-3",
                                        "scripts/make_eagle3_draft.py")
    ids = resolve_aux_layers(draft_cfg, target_cfg).aux_layer_ids
    require(len(ids) == NUM_AUX and all(0 <= i <= target_cfg.num_hidden_layers for i in ids),
            f"{FLAG}: draft {path} reads aux layers {list(ids)} but the target has "
            f"{target_cfg.num_hidden_layers} layers (EAGLE-3 reads {NUM_AUX} distinct ones)")


def save_draft(path, cfg, state):
    """Write a draft directory (config.json + model.safetensors) vLLM serves unchanged."""
    write_draft_dir(path, to_hf_dict(cfg), state)


def load_draft(path):
    """(Eagle3Config, state dict) of a draft directory."""
    cfg = read_draft_config(path)
    return cfg, read_draft_tensors(path, _not_a_draft, ("fc.weight", "midlayer.self_attn.q_proj.weight",
                                                        "lm_head.weight"))
