"""The speculative-decoding config (`--vllm-speculative-config`): one typed `SpecConfig`, parsed once.

The config is vLLM's SpeculativeConfig JSON (or a YAML mapping). It is read once, where the run's
config is loaded (vime/cli_config.py), into a frozen `SpecConfig` in vLLM's field names; the engines,
the trainer and the pre-start checks all read that object. What the fields may hold depends on the
engine that runs them, so each rollout backend has its reader (`SPEC_READERS`):

- embedded: vime's engine implements a subset of vLLM's schema, validated here in full (every bad
  input is one `UserError` line naming the flag and what to do), aliases resolved, vLLM's defaults;
- vllm: vLLM validates its own schema (rollout/vllm/backend.py runs that before any actor starts);
  only what vime itself acts on is read (method, draft, verification), and the keys both engines know
  are held to their JSON types as on the embedded engine.

On both, a key given twice is refused (JSON itself would keep the last one without a word).

Either way `to_vllm()` gives the config exactly as written, the draft path made absolute, which is
what vLLM is handed.

The checks of a parsed config live here too: the run's rules (`check_run_rules`: no synthetic
acceptance in training, at most one way to choose k, `RUN_RULES`), and those against the target
checkpoint that hold on every engine (`check_against_checkpoint`, `check_external_draft`). What only one
engine needs is checked beside that engine (rollout/embedded/engine_builder.py, rollout/vllm/backend.py).
"""
import copy
import dataclasses
import difflib
import json
from dataclasses import dataclass

from mtp.rejection import REJECTION_METHODS
from vime.errors import UserError, require
from vime.models.draft_kinds import DRAFT_KINDS, METHOD_ALIASES, external_kind

FLAG = "--vllm-speculative-config"
ADAPTIVE_FLAG = "--spec-adaptive"
EXAMPLE = '\'{"method":"mtp","num_speculative_tokens":3}\''

# the embedded engine's methods under every name vLLM gives them: METHOD_ALIASES (the table of kinds)
BLOCK_METHODS = frozenset(name for name, kind in DRAFT_KINDS.items() if kind.block)  # a whole block per forward
UNSUPPORTED_METHODS = ("eagle", "medusa", "mlp_speculator", "ngram_gpu",
                       "custom_class", "extract_hidden_states")
# methods whose drafts come with a confidence that can size verification (enable_adaptive_verification)
CONFIDENCE_METHODS = tuple(name for name, kind in DRAFT_KINDS.items() if kind.confidence)
# vLLM 0.32 SpeculativeConfig keys the embedded engine does not implement (vLLM takes them as is)
VLLM_ONLY_KEYS = ("draft_sample_method", "parallel_drafting",
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

# methods that draft with a separate checkpoint -> what to give (the same on every backend)
NEEDS_MODEL = {name: kind.needs_model for name, kind in DRAFT_KINDS.items() if kind.needs_model}


@dataclass(frozen=True)
class SpecConfig:
    """A speculative config in vLLM's SpeculativeConfig field names (no config: no speculation).

    The typed fields are what vime acts on; `given` keeps the (key, value) pairs as written, so
    `to_vllm()` hands vLLM every key it knows, unchanged."""

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
    # vLLM's: verify per step only as many drafts as the draft's confidence makes worth it (DSpark); with
    # num_speculative_tokens_per_batch_size that schedule says where the block is drafted
    enable_adaptive_verification: bool = False
    given: tuple = dataclasses.field(default=(), repr=False)

    @property
    def is_lossy(self):
        """True when outputs no longer follow the target distribution (synthetic acceptance):
        benchmark-only; training must refuse it."""
        return self.rejection_sample_method == "synthetic"

    @property
    def block_size(self):
        """Tokens one draft forward fills, anchor included, for a block draft (its drafts plus the newest
        verified token, or its drafts alone where the anchor's slot drafts too; the draft's checks tie it
        to its own block); None otherwise."""
        if self.method not in BLOCK_METHODS:
            return None
        return self.num_speculative_tokens + (0 if DRAFT_KINDS[self.method].anchor_drafts else 1)

    def to_vllm(self):
        """The config as vLLM takes it: the keys as written (a fresh dict each call)."""
        return {key: copy.deepcopy(value) for key, value in self.given}

    def with_model(self, path):
        """The same config with its draft at `path` (e.g. made absolute for actors in another directory)."""
        given = tuple((key, path if key == "model" else value) for key, value in self.given)
        return dataclasses.replace(self, model=path, given=given)


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
    "enable_adaptive_verification": ((bool,), "true or false"),
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


def parse_spec_config(value, backend="embedded"):
    """SpecConfig for `backend` from a JSON string, a mapping, or None / "" / "none" (-> None: no speculation)."""
    read = spec_reader(backend)
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    raw = _load_json(value) if isinstance(value, str) else value
    require(isinstance(raw, dict), f"{FLAG} must be a JSON object like {EXAMPLE} (got {type(raw).__name__})")
    return read(dict(raw))


def as_spec_config(value, backend="embedded"):
    """`value` when it is already a SpecConfig (or None), else `parse_spec_config(value, backend)`: for
    callers that take either (tools and tests hand the engines JSON or mappings)."""
    return value if value is None or isinstance(value, SpecConfig) else parse_spec_config(value, backend)


def _load_json(text):
    try:
        return json.loads(text, object_pairs_hook=_once_each)
    except json.JSONDecodeError as e:
        raise UserError(f"{FLAG}: malformed JSON ({e.msg} at column {e.colno}); pass an object like {EXAMPLE}") \
            from None


def _once_each(pairs):
    """A JSON object's pairs as a dict, refusing a key given twice (json.loads would keep the last silently)."""
    seen = {}
    for key, value in pairs:
        require(key not in seen, f"{FLAG}: key {key!r} is given twice ({json.dumps(seen.get(key))} and "
                f"{json.dumps(value)}); give it once")
        seen[key] = value
    return seen


def _read_for_embedded(raw):
    """vime's engine: the whole config validated against the subset of vLLM's schema it implements."""
    _check_keys(raw)
    for key, val in raw.items():
        _check_type(key, val)
        _check_range(key, val)
    given = tuple(raw.items())
    method = raw["method"]
    require(method not in UNSUPPORTED_METHODS,
            f"{FLAG}: method {method!r} runs on vLLM only ({USE_VLLM}); the embedded engine has "
            f"{', '.join(dict.fromkeys(METHOD_ALIASES.values()))}")
    require(method in METHOD_ALIASES, f"{FLAG}: unknown method {method!r}; use one of "
            f"{', '.join(sorted(METHOD_ALIASES))}")
    raw["method"] = METHOD_ALIASES[method]
    _lookup_bounds(raw)
    _rejection(raw)
    _batch_schedule(raw)
    _adaptive_verification(raw)
    require(raw.get("draft_tensor_parallel_size", 1) == 1,
            f"{FLAG}: draft_tensor_parallel_size must be 1 for the embedded engine "
            f"(got {raw.get('draft_tensor_parallel_size')})")
    _require_model(raw)
    return SpecConfig(**raw, given=given)


def _read_for_vllm(raw):
    """vLLM: its own validation judges the config (before any actor starts); vime reads the method,
    the draft and the verification, and needs the draft named (the pre-start checks open it). The keys
    both engines know must have their JSON types here too: vLLM would cast a string "2" to 2, where the
    embedded engine refuses it, and a config means the same on either backend."""
    for key, val in raw.items():
        if key in _TYPES:
            _check_type(key, val)
    method = raw.get("method")
    if isinstance(method, str):
        method = METHOD_ALIASES.get(method, method)
        _require_model(dict(raw, method=method))
    kept = {key: raw[key] for key in ("num_speculative_tokens", "model", "rejection_sample_method",
                                      "enable_adaptive_verification") if key in raw}
    return SpecConfig(method=method, **{"num_speculative_tokens": None, **kept}, given=tuple(raw.items()))


# --rollout-backend -> how its speculative config is read (rollout/backend.py BACKENDS has the same names)
SPEC_READERS = {"embedded": _read_for_embedded, "vllm": _read_for_vllm}


def spec_reader(backend):
    """The reader of `backend`'s speculative config; an unknown backend is one line naming the choices."""
    require(backend in SPEC_READERS, f"--rollout-backend {backend!r}: choose one of {', '.join(SPEC_READERS)}")
    return SPEC_READERS[backend]


def _require_model(raw):
    method = raw["method"]
    require(method not in NEEDS_MODEL or raw.get("model"), f"{FLAG}: method {method!r} needs {NEEDS_MODEL.get(method)}")


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
    ok = isinstance(val, types) and (bool in types or not isinstance(val, bool))
    require(ok, f"{FLAG}: {key} must be {name} (got {json.dumps(val)})")


def _check_range(key, val):
    if key not in _RANGES or val is None:
        return
    pred, wording = _RANGES[key]
    require(pred(val), f"{FLAG}: {key} must be {wording} (got {val})")


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


def _adaptive_verification(raw):
    """vLLM's enable_adaptive_verification sizes verification by a draft's confidence (DSpark's head); a batch-size
    schedule beside it says where the block is drafted, as vLLM takes the two together."""
    require(not raw.get("enable_adaptive_verification") or raw["method"] in CONFIDENCE_METHODS,
            f"{FLAG}: enable_adaptive_verification sizes verification by the draft's confidence head, which "
            f"method {raw['method']!r} has not (use it with {', '.join(CONFIDENCE_METHODS)}, or --spec-adaptive "
            "to choose k per batch size from measured acceptance)")


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


# ------------------------------------------------------------------ the run's rules (read no file)
@dataclass(frozen=True)
class RunRule:
    """A rule between the speculative config and vime's own flags: `broken(spec, r)` is true when the run
    breaks it (r: `cfg.rollout`, or `SpecFlags`), `says` the one line then (after the flag names)."""

    names: str
    broken: object
    says: str


# Every rule of this kind in one table, judged in order by `check_run_rules`: a new mechanism that chooses
# k, or a knob that a mode ignores, adds its row here.
RUN_RULES = (
    RunRule(f"{ADAPTIVE_FLAG}", lambda spec, r: r.spec_adaptive and spec is None,
            f"chooses how many tokens to draft, so it needs {FLAG} (e.g. {EXAMPLE})"),
    RunRule(f"{ADAPTIVE_FLAG} and num_speculative_tokens_per_batch_size in {FLAG}",
            lambda spec, r: r.spec_adaptive and spec.num_speculative_tokens_per_batch_size is not None,
            "both choose k per step; give one of them"),
    RunRule(f"{ADAPTIVE_FLAG} and enable_adaptive_verification in {FLAG}",
            lambda spec, r: r.spec_adaptive and spec.enable_adaptive_verification,
            "both choose how many drafts a step verifies (the draft's confidence would decide, and "
            f"{ADAPTIVE_FLAG} be ignored); give one of them"),
)


def check_spec_adaptive(spec, adaptive):
    """vime's --spec-adaptive: a boolean, judged with the speculative config by `RUN_RULES`."""
    require(isinstance(adaptive, bool), f"{ADAPTIVE_FLAG} must be true or false (got {adaptive!r})")
    check_rules(spec, SpecFlags(adaptive))


@dataclass(frozen=True)
class SpecFlags:
    """vime's own speculation flags under their `cfg.rollout` names, for callers without the config tree."""

    spec_adaptive: bool = False


def check_rules(spec, rollout_cfg):
    """One line for the first rule of `RUN_RULES` the run breaks."""
    for rule in RUN_RULES:
        require(not rule.broken(spec, rollout_cfg), f"{rule.names} {rule.says}")


def require_lossless(spec, where="training"):
    """Refuse synthetic acceptance where samples must follow the policy (RL training)."""
    require(spec is None or not spec.is_lossy,
            f"{FLAG}: rejection_sample_method 'synthetic' is benchmark-only (its outputs do not follow the "
            f"policy), so {where} refuses it; verify with a lossless rejection_sample_method")


def check_run_rules(rollout_cfg):
    """A training run's speculative config and vime's own speculation flags (`cfg.rollout`), before any file is
    read: samples that follow the policy, and the rules between the config and the flags."""
    require_lossless(rollout_cfg.vllm_speculative_config, where="train_rl.py")
    check_spec_adaptive(rollout_cfg.vllm_speculative_config, rollout_cfg.spec_adaptive)


# ------------------------------------------------------------------ against the target checkpoint
def check_draft_vocab(draft_path, draft_vocab, target_vocab):
    """The draft must share the target's vocabulary (one-line error otherwise)."""
    require(draft_vocab == target_vocab,
            f"{FLAG}: draft model {draft_path} has vocab_size {draft_vocab} but the target has "
            f"{target_vocab}; the draft must share the target's tokenizer")


def check_against_checkpoint(spec, target_cfg):
    """Checks that need the target's ModelConfig: MTP layers, draft vocabulary, an external draft's fit."""
    if spec is None:
        return
    if spec.method == "mtp":
        require(target_cfg.num_nextn_predict_layers > 0,
                f"{FLAG}: method 'mtp' needs a checkpoint with MTP layers, but this one has "
                "num_nextn_predict_layers=0; use ngram/suffix/draft_model or a checkpoint with MTP weights")
    if spec.method == "draft_model":
        from vime.models.hf_format import read_config

        draft_cfg = read_config(spec.model, f"{FLAG} model")
        check_draft_vocab(spec.model, draft_cfg.vocab_size, target_cfg.vocab_size)
    check_external_draft(spec, target_cfg)


def check_external_draft(spec, target_cfg):
    """An external draft is a draft directory of its kind that fits the target and the drafts asked
    for, its tensors those its config implies (one line each, nothing loaded). Run for both backends:
    vLLM's own validation accepts a misfit draft and fails later inside its engine process. Any
    family is a target (the embedded engine computes the aux hidden states of every family; what
    vLLM's models return is the vLLM backend's own check)."""
    kind = external_kind(spec.method) if spec is not None else None
    if kind is not None:
        kind.check_directory(spec.model, target_cfg, spec.num_speculative_tokens)
