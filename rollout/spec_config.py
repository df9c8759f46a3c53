"""The speculative-decoding config: vLLM's SpeculativeConfig schema, parsed and validated.

Accepts the JSON string of `--vllm-speculative-config` or a mapping (a YAML subtree) and
returns a frozen `SpecConfig`. Every bad input is a one-line `UserError` that names the
flag and says what to do. Checks that need the target checkpoint (MTP layers present,
draft vocabulary) live in `check_against_checkpoint`. `engine_config_for` gives the engine
its slice (rejection method); rollout/embedded/engine_builder.py turns a config into a proposer and an
engine. `check_spec_adaptive` validates vime's own --spec-adaptive flag, which lives outside
the JSON so the JSON stays vLLM's.
"""
import dataclasses
import difflib
import json
from dataclasses import dataclass

from mtp.rejection import REJECTION_METHODS
from vime.errors import UserError, require

FLAG = "--vllm-speculative-config"
ADAPTIVE_FLAG = "--spec-adaptive"

METHOD_ALIASES = {"mtp": "mtp", "deepseek_mtp": "mtp", "mimo_mtp": "mtp", "glm4_moe_mtp": "mtp",
                  "ngram": "ngram", "suffix": "suffix", "draft_model": "draft_model", "eagle3": "eagle3"}
UNSUPPORTED_METHODS = ("eagle", "medusa", "mlp_speculator", "dflash", "ngram_gpu", "dspark",
                       "custom_class", "extract_hidden_states")
# vLLM 0.32 SpeculativeConfig keys the embedded engine does not implement (vLLM takes them as is)
VLLM_ONLY_KEYS = ("draft_sample_method", "parallel_drafting", "enable_adaptive_verification",
                  "disable_padded_drafter_batch", "quantization", "revision", "code_revision", "max_model_len",
                  "enforce_eager", "kv_cache_dtype", "attention_backend", "moe_backend", "use_local_argmax_reduction",
                  "index_share_for_mtp_iteration", "disable_eagle_block_drop", "dspark_draft_topk",
                  "use_heterogeneous_vocab", "draft_load_config")
USE_VLLM = "add --rollout-backend vllm, which hands the config to vLLM unchanged"

# keys users reach for that belong elsewhere: key -> what to say instead
MISPLACED_KEYS = {
    "tensor_parallel_size": "is not a speculative-config key; use draft_tensor_parallel_size",
    "temperature": "is a sampling parameter, not a speculative-config key; set it with the sampling flags",
    "top_p": "is a sampling parameter, not a speculative-config key; set it with the sampling flags",
    "top_k": "is a sampling parameter, not a speculative-config key; set it with the sampling flags",
    "seed": "is a sampling parameter, not a speculative-config key; set it with the sampling flags",
}


@dataclass(frozen=True)
class SpecConfig:
    """A validated speculative config, in vLLM's SpeculativeConfig field names (no config: no speculation)."""

    method: str
    num_speculative_tokens: int
    model: str = None
    draft_tensor_parallel_size: int = 1
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    rejection_sample_method: str = "strict"
    synthetic_acceptance_rate: float = None
    # vLLM's per-position *unconditional* rates: entry i = P(first i+1 drafts all accepted)
    synthetic_acceptance_rates: tuple = None
    synthetic_acceptance_length: float = None
    # vLLM's dynamic schedule: ((range_start, range_end, k), ...), inclusive, sorted
    num_speculative_tokens_per_batch_size: tuple = None

    @property
    def is_lossy(self):
        """True when outputs no longer follow the target distribution (synthetic acceptance):
        benchmark-only; training must refuse it."""
        return self.rejection_sample_method == "synthetic"


# key -> (accepted python types, type name for the error)
_TYPES = {
    "method": ((str,), "a string"),
    "num_speculative_tokens": ((int,), "an integer"),
    "model": ((str,), "a string (a checkpoint directory)"),
    "draft_tensor_parallel_size": ((int,), "an integer"),
    "prompt_lookup_min": ((int,), "an integer"),
    "prompt_lookup_max": ((int,), "an integer"),
    "suffix_decoding_max_tree_depth": ((int,), "an integer"),
    "suffix_decoding_max_cached_requests": ((int,), "an integer"),
    "suffix_decoding_max_spec_factor": ((int, float), "a number"),
    "suffix_decoding_min_token_prob": ((int, float), "a number"),
    "rejection_sample_method": ((str,), "a string"),
    "synthetic_acceptance_rate": ((int, float), "a number"),
    "synthetic_acceptance_rates": ((list,), "a list of numbers in [0, 1], one per draft position"),
    "synthetic_acceptance_length": ((int, float), "a number"),
    "num_speculative_tokens_per_batch_size": ((list,), "a list of [range_start, range_end, k] entries"),
}

_NULLABLE = ("model", "synthetic_acceptance_rate", "synthetic_acceptance_rates", "synthetic_acceptance_length",
             "num_speculative_tokens_per_batch_size")

# key -> (predicate, wording of the allowed range)
_RANGES = {
    "num_speculative_tokens": (lambda v: v > 0, "> 0"),
    "draft_tensor_parallel_size": (lambda v: v >= 1, ">= 1"),
    "prompt_lookup_min": (lambda v: v >= 1, ">= 1"),
    "prompt_lookup_max": (lambda v: v >= 1, ">= 1"),
    "suffix_decoding_max_tree_depth": (lambda v: v >= 1, ">= 1"),
    "suffix_decoding_max_cached_requests": (lambda v: v >= 0, ">= 0 (0 disables the cache)"),
    "suffix_decoding_max_spec_factor": (lambda v: v > 0, "> 0"),
    "suffix_decoding_min_token_prob": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "synthetic_acceptance_rate": (lambda v: 0 <= v <= 1, "in [0, 1]"),
}


def parse_spec_config(value):
    """SpecConfig from a JSON string, a mapping, or None (-> None: no speculation)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    raw = _load_json(value) if isinstance(value, str) else value
    require(isinstance(raw, dict), f"{FLAG} must be a JSON object like "
            '\'{"method":"mtp","num_speculative_tokens":3}\' (got ' + type(raw).__name__ + ")")
    _check_keys(raw)
    for key, val in raw.items():
        _check_type(key, val)
        _check_range(key, val)
    return _finish(dict(raw))


def _load_json(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{FLAG}: malformed JSON ({e.msg} at column {e.colno}); pass an object like "
                        '\'{"method":"mtp","num_speculative_tokens":3}\'') from None


def _check_keys(raw):
    known = set(_TYPES)
    for key in raw:
        if key in MISPLACED_KEYS:
            raise UserError(f"{FLAG}: {key!r} {MISPLACED_KEYS[key]}")
        if key in VLLM_ONLY_KEYS and key not in known:
            raise UserError(f"{FLAG}: key {key!r} is vLLM's; the embedded engine does not implement it: {USE_VLLM}")
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
            raise UserError(f"{FLAG}: unknown key {key!r}{hint}")
    require("method" in raw, f"{FLAG}: 'method' is required (one of {', '.join(sorted(METHOD_ALIASES))})")
    require("num_speculative_tokens" in raw, f"{FLAG}: 'num_speculative_tokens' is required (an integer > 0)")


def _check_type(key, val):
    types, name = _TYPES[key]
    if key in _NULLABLE and val is None:
        return
    ok = isinstance(val, types) and not isinstance(val, bool)
    require(ok, f"{FLAG}: {key} must be {name} (got {json.dumps(val)})")


def _check_range(key, val):
    if key not in _RANGES or val is None:
        return
    pred, wording = _RANGES[key]
    require(pred(val), f"{FLAG}: {key} must be {wording} (got {val})")


def _finish(raw):
    method = raw["method"]
    require(method not in UNSUPPORTED_METHODS,
            f"{FLAG}: method {method!r} runs on vLLM only ({USE_VLLM}); the embedded engine has "
            "mtp, ngram, suffix, draft_model, eagle3")
    require(method in METHOD_ALIASES, f"{FLAG}: unknown method {method!r}; use one of "
            f"{', '.join(sorted(METHOD_ALIASES))}")
    raw["method"] = METHOD_ALIASES[method]
    _lookup_bounds(raw)
    _rejection(raw)
    _batch_schedule(raw)
    require(raw.get("draft_tensor_parallel_size", 1) == 1,
            f"{FLAG}: draft_tensor_parallel_size must be 1 for the embedded engine "
            f"(got {raw.get('draft_tensor_parallel_size')})")
    require(raw["method"] != "draft_model" or raw.get("model"),
            f"{FLAG}: method 'draft_model' needs \"model\": \"/path/to/draft/hf/checkpoint\"")
    require(raw["method"] != "eagle3" or raw.get("model"),
            f"{FLAG}: method 'eagle3' needs \"model\": \"/path/to/eagle3/draft\" (make one with "
            "`python scripts/make_eagle3_draft.py --target CKPT --out DIR`)")
    return SpecConfig(**raw)


def _lookup_bounds(raw):
    lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
    require(lo <= hi, f"{FLAG}: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
    raw["prompt_lookup_min"], raw["prompt_lookup_max"] = lo, hi


def _rejection(raw):
    method = raw.setdefault("rejection_sample_method", "strict")
    require(method in REJECTION_METHODS,
            f"{FLAG}: rejection_sample_method must be one of {', '.join(REJECTION_METHODS)} (got {method!r})")
    given = [key for key in ("synthetic_acceptance_rate", "synthetic_acceptance_rates", "synthetic_acceptance_length")
             if raw.get(key) is not None]
    if method != "synthetic":
        require(not given, f"{FLAG}: {given[0] if given else ''} only applies with rejection_sample_method 'synthetic'")
        return
    require(len(given) == 1, f"{FLAG}: rejection_sample_method 'synthetic' needs exactly one of "
            "synthetic_acceptance_rate (per draft), synthetic_acceptance_rates (per position) or "
            f"synthetic_acceptance_length (got {', '.join(given) or 'none'})")
    n = raw["num_speculative_tokens"]
    if raw.get("synthetic_acceptance_rates") is not None:
        rates = raw["synthetic_acceptance_rates"]
        require(len(rates) == n and all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1
                                        for r in rates),
                f"{FLAG}: synthetic_acceptance_rates must be {n} numbers in [0, 1] "
                f"(one per draft position; got {json.dumps(rates)})")
        require(all(b <= a for a, b in zip(rates, rates[1:])),
                f"{FLAG}: synthetic_acceptance_rates must be non-increasing (entry i is the chance that "
                f"the first i+1 drafts are all accepted; got {json.dumps(rates)})")
        raw["synthetic_acceptance_rates"] = tuple(float(r) for r in rates)
    if raw.get("synthetic_acceptance_length") is not None:
        length = raw["synthetic_acceptance_length"]
        require(1 <= length <= n + 1, f"{FLAG}: synthetic_acceptance_length must be in [1, {n + 1}] (got {length})")


def synthetic_position_rates(spec):
    """Conditional acceptance per draft position for synthetic verification (None otherwise):
    the per-draft rate repeated, or vLLM's unconditional rates / mean length converted."""
    if spec is None or not spec.is_lossy:
        return None
    n = spec.num_speculative_tokens
    if spec.synthetic_acceptance_rate is not None:
        return (float(spec.synthetic_acceptance_rate),) * n
    if spec.synthetic_acceptance_rates is not None:
        unconditional = spec.synthetic_acceptance_rates
    else:  # a mean length: the lowest-variance schedule, all-or-nothing but one fractional position
        extra = spec.synthetic_acceptance_length - 1
        unconditional = tuple(min(1.0, max(0.0, extra - i)) for i in range(n))
    conditional, before = [], 1.0
    for u in unconditional:
        conditional.append(u / before if before > 0 else 0.0)
        before = u
    return tuple(conditional)


def _batch_schedule(raw):
    """vLLM's num_speculative_tokens_per_batch_size, validated like vLLM and stored sorted."""
    sched = raw.get("num_speculative_tokens_per_batch_size")
    if sched is None:
        return
    key = f"{FLAG}: num_speculative_tokens_per_batch_size"
    require(sched, f"{key} must not be empty; give [[1, 8, 3], [9, 128, 1]]-style [range_start, range_end, k] entries")
    entries = []
    for e in sched:
        ok = isinstance(e, list) and len(e) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in e)
        require(ok, f"{key}: each entry must be [range_start, range_end, k] integers (got {json.dumps(e)})")
        start, end, k = e
        require(start >= 1 and end >= 1, f"{key}: batch-size range {json.dumps(e[:2])} must be positive")
        require(start <= end, f"{key}: range start must be <= end (got {json.dumps(e)})")
        require(k >= 0, f"{key}: k must be >= 0 (got {json.dumps(e)})")
        entries.append((start, end, k))
    entries.sort()
    for (_, prev_end, _), (start, _, _) in zip(entries, entries[1:]):
        require(start > prev_end, f"{key}: batch-size ranges overlap at {start}")
    require(entries[0][0] == 1, f"{key}: the first range must start at 1 so every batch size has a k "
            f"(got {entries[0][0]})")
    raw["num_speculative_tokens_per_batch_size"] = tuple(entries)


def check_spec_adaptive(spec, adaptive):
    """vime's --spec-adaptive: a boolean, only with speculation, not with vLLM's fixed schedule."""
    require(isinstance(adaptive, bool), f"{ADAPTIVE_FLAG} must be true or false (got {adaptive!r})")
    if not adaptive:
        return
    require(spec is not None, f"{ADAPTIVE_FLAG} chooses how many tokens to draft, so it needs {FLAG} "
            '(e.g. \'{"method":"mtp","num_speculative_tokens":3}\')')
    require(spec.num_speculative_tokens_per_batch_size is None,
            f"{ADAPTIVE_FLAG} and num_speculative_tokens_per_batch_size in {FLAG} both choose k per step; "
            "give one of them")


# ------------------------------------------------------------------ checkpoint-dependent checks
def check_draft_vocab(draft_path, draft_vocab, target_vocab):
    """The draft must share the target's vocabulary (one-line error otherwise)."""
    require(draft_vocab == target_vocab,
            f"{FLAG}: draft model {draft_path} has vocab_size {draft_vocab} but the target has "
            f"{target_vocab}; the draft must share the target's tokenizer")


def check_against_checkpoint(spec, target_cfg):
    """Checks that need the target's ModelConfig: MTP layers, draft vocabulary, an EAGLE-3 draft's fit."""
    if spec is None:
        return
    if spec.method == "mtp":
        require(target_cfg.num_nextn_predict_layers > 0,
                f"{FLAG}: method 'mtp' needs a checkpoint with MTP layers, but this one has "
                "num_nextn_predict_layers=0; use ngram/suffix/draft_model or a checkpoint with MTP weights")
    if spec.method == "draft_model":
        from vime.models.hf_format import read_config

        draft_cfg = read_config(spec.model)
        check_draft_vocab(spec.model, draft_cfg.vocab_size, target_cfg.vocab_size)
    if spec.method == "eagle3":
        check_eagle3_draft(spec.model, target_cfg)


def check_eagle3_draft(draft_path, target_cfg):
    """An EAGLE-3 draft is named, is a draft directory, fits the target, and the target's family
    gives aux hidden states (one line each). Run for both backends: vLLM's own validation
    accepts a MiMo target or a misfit draft and fails later inside its engine process."""
    from vime.models.eagle3 import check_draft_fits_target, read_draft_config

    require(draft_path, f"{FLAG}: method 'eagle3' needs \"model\": \"/path/to/eagle3/draft\" (make one with "
            "`python scripts/make_eagle3_draft.py --target CKPT --out DIR`)")
    check_draft_fits_target(draft_path, read_draft_config(draft_path), target_cfg)


def require_lossless(spec, where="training"):
    """Refuse synthetic acceptance where samples must follow the policy (RL training)."""
    require(spec is None or not spec.is_lossy,
            f"{FLAG}: rejection_sample_method 'synthetic' is benchmark-only (its outputs do not follow the "
            f"policy), so {where} refuses it; use 'strict' or 'probabilistic'")


def engine_config_for(spec, engine_config):
    """The engine's slice of the spec config: how drafts are verified."""
    if spec is None:
        return engine_config
    return dataclasses.replace(engine_config, rejection_sample_method=spec.rejection_sample_method,
                               synthetic_acceptance_rates=synthetic_position_rates(spec))
