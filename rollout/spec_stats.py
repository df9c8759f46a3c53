"""Aggregate speculative-decoding statistics, token-weighted (pure).

Counts are summed first and divided once, so long responses weigh by their tokens (a mean
of per-sample ratios would not). The sums are a plain dict of counters (`spec_counters`),
so counters from several workers, or read from another engine (vLLM's
`vllm:spec_decode_*`), combine by addition before the rates are taken (`spec_rates`).
Keys are logged as rollout/<key>.

One definition for both backends, vLLM's: a *draft* is one drafting step of one request
(a proposal of one or more tokens, verified in one forward); the acceptance length is
1 + accepted tokens / drafts (each verification emits its accepted drafts plus one token);
the rate at position i is the accepted tokens at i over the drafts that reached position i.
"""

COUNTER_KEYS = ("drafts", "draft_tokens", "accepted_tokens")


def empty_counters():
    return {**{k: 0 for k in COUNTER_KEYS}, "drafted_per_pos": [], "accepted_per_pos": []}


def add_counters(a, b):
    """Elementwise sum of two counter dicts (per-position lists padded with zeros)."""
    out = {k: a[k] + b[k] for k in COUNTER_KEYS}
    for key in ("drafted_per_pos", "accepted_per_pos"):
        width = max(len(a[key]), len(b[key]))
        out[key] = [(a[key][i] if i < len(a[key]) else 0) + (b[key][i] if i < len(b[key]) else 0)
                    for i in range(width)]
    return out


def spec_counters(samples):
    """Counters of `samples` (objects with .spec and .response_ids) from the embedded engine."""
    out = empty_counters()
    out.update(draft_tokens=sum(s.spec.draft_tokens for s in samples),
               accepted_tokens=sum(s.spec.accepted_tokens for s in samples))
    width = max((len(s.spec.drafted_per_pos) for s in samples), default=0)
    for key in ("drafted_per_pos", "accepted_per_pos"):
        out[key] = [sum(getattr(s.spec, key)[i] for s in samples if i < len(getattr(s.spec, key)))
                    for i in range(width)]
    # every drafting step proposes a token at position 0
    out["drafts"] = out["drafted_per_pos"][0] if width else 0
    return out


def spec_rates(c):
    """{spec_accept_rate, spec_accept_length, spec_accept_rate_pos_{i}, spec_draft_tokens,
    spec_accepted_tokens} from summed counters."""
    out = {
        "spec_draft_tokens": c["draft_tokens"],
        "spec_accepted_tokens": c["accepted_tokens"],
        "spec_accept_rate": c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else 0.0,
        # every verification emits its accepted drafts plus one bonus/correction token
        "spec_accept_length": 1.0 + c["accepted_tokens"] / c["drafts"] if c["drafts"] else 1.0,
    }
    for i, (d, a) in enumerate(zip(c["drafted_per_pos"], c["accepted_per_pos"])):
        out[f"spec_accept_rate_pos_{i}"] = a / d if d else 0.0
    return out


def aggregate_spec_stats(samples):
    """The rates over `samples` (see spec_rates)."""
    return spec_rates(spec_counters(samples))


def format_spec_stats(stats):
    """One human-readable line of an aggregate."""
    pos = " ".join(f"{stats[k]:.2f}" for k in sorted(stats) if k.startswith("spec_accept_rate_pos_"))
    return (f"spec: accept_rate {stats['spec_accept_rate']:.3f}  accept_length {stats['spec_accept_length']:.3f}  "
            f"drafted {stats['spec_draft_tokens']}  accepted {stats['spec_accepted_tokens']}  per-pos [{pos}]")
