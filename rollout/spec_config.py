"""The engine side of the speculative config: what a parsed `SpecConfig` (vime/spec_config.py) means
for a rollout engine and a target checkpoint.

Checks that need the target checkpoint (MTP layers present, a draft's vocabulary and fit) live in
`check_against_checkpoint`; the external drafts' own checks (`check_external_draft`) run for both
backends. `engine_config_for` gives the embedded engine its slice (rejection method);
rollout/embedded/engine_builder.py turns a config into a proposer and an engine. `check_spec_adaptive`
validates vime's own --spec-adaptive flag, which lives outside the JSON so the JSON stays vLLM's.
"""
import dataclasses

from vime.errors import require
from vime.models.draft_kinds import external_kind
from vime.spec_config import FLAG, EXAMPLE, SpecConfig, parse_spec_config  # noqa: F401  (the engines' names for them)

ADAPTIVE_FLAG = "--spec-adaptive"


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


def check_spec_adaptive(spec, adaptive):
    """vime's --spec-adaptive: a boolean, only with speculation, not with vLLM's fixed schedule."""
    require(isinstance(adaptive, bool), f"{ADAPTIVE_FLAG} must be true or false (got {adaptive!r})")
    if not adaptive:
        return
    require(spec is not None, f"{ADAPTIVE_FLAG} chooses how many tokens to draft, so it needs {FLAG} "
            f"(e.g. {EXAMPLE})")
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


def require_lossless(spec, where="training"):
    """Refuse synthetic acceptance where samples must follow the policy (RL training)."""
    require(spec is None or not spec.is_lossy,
            f"{FLAG}: rejection_sample_method 'synthetic' is benchmark-only (its outputs do not follow the "
            f"policy), so {where} refuses it; verify with a lossless rejection_sample_method")


def engine_config_for(spec, engine_config):
    """The engine's slice of the spec config: how drafts are verified."""
    if spec is None:
        return engine_config
    return dataclasses.replace(engine_config, rejection_sample_method=spec.rejection_sample_method,
                               synthetic_acceptance_rates=synthetic_position_rates(spec))
