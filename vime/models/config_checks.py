"""Validation of an HF checkpoint's config.json values and weights (pure: json, torch, safetensors).

`read_config` parses the file; these checks make sure what it parsed can build a model, so a
wrong value is one line naming the file and the key instead of a traceback inside an actor:
- `check_raw_config(raw, source)`: types and ranges of the architecture keys;
- `check_finite_weights(path)`: NaN/inf in model.safetensors (a corrupted file loads fine
  otherwise and generates garbage).
"""
from vime.errors import UserError, require
from vime.models.families import FAMILIES

NGRAM_EXAMPLE = '\'{"method":"ngram","num_speculative_tokens":2}\''  # drafts without MTP layers or a draft model
# key -> smallest allowed value; every one must be a JSON integer
POSITIVE_INT_KEYS = {
    "vocab_size": 1, "hidden_size": 1, "intermediate_size": 1, "num_hidden_layers": 1,
    "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 1, "max_position_embeddings": 2,
    "num_nextn_predict_layers": 0,
}
POSITIVE_FLOAT_KEYS = ("rms_norm_eps", "rope_theta")


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _latent_attention(raw):
    """The config is of a family with multi-head latent attention (its num_key_value_heads means nothing)."""
    archs = raw.get("architectures") or []
    return any(f.attention == "mla" and any(a in f.architectures for a in archs) for f in FAMILIES.values())


def check_raw_config(raw, source="config.json"):
    """One-line UserError for an architecture value of the wrong type or out of range."""
    for key, lowest in POSITIVE_INT_KEYS.items():
        if key not in raw or raw[key] is None:
            continue
        value = raw[key]
        require(_is_int(value) and value >= lowest,
                f"{source}: {key!r} must be an integer >= {lowest} (got {value!r}); fix config.json")
    for key in POSITIVE_FLOAT_KEYS:
        if raw.get(key) is None:
            continue
        value = raw[key]
        require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                f"{source}: {key!r} must be a number > 0 (got {value!r}); fix config.json")
    heads, kv = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if _is_int(heads) and _is_int(kv) and not _latent_attention(raw):  # MLA has no KV heads
        require(heads % kv == 0, f"{source}: num_attention_heads {heads} must be a multiple of "
                f"num_key_value_heads {kv}; fix config.json")
    if raw.get("head_dim") is None and _is_int(heads) and _is_int(raw.get("hidden_size")):
        require(raw["hidden_size"] % heads == 0, f"{source}: hidden_size {raw['hidden_size']} is not a multiple of "
                f"num_attention_heads {heads} and there is no head_dim; fix config.json")


def check_finite_state(state, weights_file):
    """Every floating tensor of `state` (loaded from weights_file) is finite."""
    import torch

    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise UserError(f"{weights_file}: tensor {name} holds NaN or inf values; the file is "
                            "corrupted: re-create or re-download it")


def check_finite_weights(weights_file):
    """Every floating tensor of a safetensors file is finite (NaN/inf means a corrupted file)."""
    from safetensors import safe_open

    try:
        with safe_open(weights_file, framework="pt") as f:
            for name in f.keys():
                check_finite_state({name: f.get_tensor(name)}, weights_file)
    except UserError:
        raise
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise UserError(f"{weights_file}: unreadable safetensors file ({str(e).splitlines()[0]}); "
                        "re-create or re-download it") from None


def check_mtp_layers(num_layers, model_cfg, hf_checkpoint, training=False):
    """--mtp-num-layers against the checkpoint: the rollout drafts with every MTP layer it has, so training
    fewer would leave the rest stale in the draft, and the sync guard could never match the trainer's. On a
    checkpoint without MTP layers, training them (`training`: --enable-mtp-training) adds fresh ones
    (orchestration/run_setup.py `add_fresh_mtp_layers`)."""
    have = model_cfg.num_nextn_predict_layers
    if num_layers is None or (have == 0 and training):
        return
    require(have > 0 or num_layers == 0,
            f"--mtp-num-layers {num_layers}: {hf_checkpoint} has no MTP layers to load; add fresh ones with "
            f"--enable-mtp-training (and --mtp-warmup-steps), or drop --mtp-num-layers and draft with another method, e.g. --vllm-speculative-config {NGRAM_EXAMPLE}, "
            "or give a checkpoint with MTP layers")
    require(num_layers <= have, f"--mtp-num-layers {num_layers}: {hf_checkpoint} has only {have} MTP layers; "
            f"pass --mtp-num-layers {have}")
    require(num_layers >= have,
            f"--mtp-num-layers {num_layers}: {hf_checkpoint} has {have} MTP layers and the rollout drafts with all of "
            f"them; pass --mtp-num-layers {have}, or keep the first {num_layers} with "
            f"checkpoint_convert.hf_to_torch_dist --mtp-num-layers {num_layers} and torch_dist_to_hf")


def fresh_mtp_layers(mtp_cfg, model_cfg):
    """How many fresh MTP layers the run adds (0: none): --mtp-num-layers of them when --enable-mtp-training
    trains MTP layers on a checkpoint (`model_cfg`) that has none (scripts/make_mtp_draft.py makes them)."""
    if mtp_cfg.enable_training and mtp_cfg.num_layers and model_cfg.num_nextn_predict_layers == 0:
        return mtp_cfg.num_layers
    return 0


def run_model_config(mtp_cfg, model_cfg):
    """The ModelConfig the run trains and serves: the checkpoint's, with its fresh MTP layers counted."""
    import dataclasses

    fresh = fresh_mtp_layers(mtp_cfg, model_cfg)
    return dataclasses.replace(model_cfg, num_nextn_predict_layers=fresh) if fresh else model_cfg
