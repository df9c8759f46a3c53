"""The check every comparison script runs before printing a ratio: both sides did the same work.

A tokens/s ratio means something only when both sides generated the same number of tokens
(greedy: the same tokens, since a greedy run that diverges measures different text). On a
mismatch the script stops with one line naming where the sides differ instead of printing a
ratio of unequal work.
"""
import sys


def responses(samples):
    """The generated token ids of each sample, in request order."""
    return [list(s.response_ids) for s in samples]


def mismatch(a, b, greedy):
    """Why two lists of responses are not the same work, or None when they are."""
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} requests"
    counts_a, counts_b = sum(map(len, a)), sum(map(len, b))
    if counts_a != counts_b:
        return f"{counts_a} vs {counts_b} generated tokens"
    if greedy:
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                at = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                return f"greedy request {i} differs at token {at}"
    return None


def require_same_work(label, a, b, greedy):
    """Exit (status 1) with one line unless responses `a` and `b` are the same work."""
    why = mismatch(a, b, greedy)
    if why is not None:
        print(f"error: {label}: the two sides did different work ({why}); no ratio printed", file=sys.stderr)
        sys.exit(1)
