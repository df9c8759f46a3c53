"""Aggregate speculative-decoding statistics over samples, token-weighted (pure).

Counts are summed over all samples first and divided once, so long responses weigh by
their tokens (a mean of per-sample ratios would not). Keys are logged as rollout/<key>.
"""


def aggregate_spec_stats(samples):
    """{spec_accept_rate, spec_accept_length, spec_accept_rate_pos_{i}, spec_draft_tokens,
    spec_accepted_tokens} over `samples` (objects with .spec and .response_ids)."""
    drafted = sum(s.spec.draft_tokens for s in samples)
    accepted = sum(s.spec.accepted_tokens for s in samples)
    steps = sum(s.spec.verify_steps for s in samples)
    generated = sum(len(s.response_ids) for s in samples)
    # the prefill forward of each sample emits exactly one token and verifies nothing; leave
    # it out so the length measures decode steps only (1.0 = no speculation gain)
    prefills = sum(1 for s in samples if s.spec.verify_steps > 0)
    decode_steps, decode_tokens = steps - prefills, generated - prefills
    out = {
        "spec_draft_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "spec_accept_rate": accepted / drafted if drafted else 0.0,
        # every verify forward emits its accepted drafts plus one bonus/correction token
        "spec_accept_length": decode_tokens / decode_steps if decode_steps > 0 else 1.0,
    }
    width = max((len(s.spec.drafted_per_pos) for s in samples), default=0)
    for i in range(width):
        d = sum(s.spec.drafted_per_pos[i] for s in samples if i < len(s.spec.drafted_per_pos))
        a = sum(s.spec.accepted_per_pos[i] for s in samples if i < len(s.spec.accepted_per_pos))
        out[f"spec_accept_rate_pos_{i}"] = a / d if d else 0.0
    return out


def format_spec_stats(stats):
    """One human-readable line of an aggregate."""
    pos = " ".join(f"{stats[k]:.2f}" for k in sorted(stats) if k.startswith("spec_accept_rate_pos_"))
    return (f"spec: accept_rate {stats['spec_accept_rate']:.3f}  accept_length {stats['spec_accept_length']:.3f}  "
            f"drafted {stats['spec_draft_tokens']}  accepted {stats['spec_accepted_tokens']}  per-pos [{pos}]")
