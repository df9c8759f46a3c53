"""N-gram (prompt lookup) proposer: copy what followed the latest earlier occurrence of the
context's last n tokens, trying n = prompt_lookup_max down to prompt_lookup_min.

Deterministic (no q: the verifier treats the drafts as one-hot, which is exact).
"""
from rollout.embedded.proposers import Proposer


def ngram_lookup(ids, k, min_n, max_n):
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram."""
    total = len(ids)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        pattern = ids[total - n:]
        first = pattern[0]
        # scan right to left so the most recent match (the one most like the current text) wins
        for j in range(total - n - 1, -1, -1):
            if ids[j] == first and ids[j:j + n] == pattern:
                return ids[j + n:j + n + k]
    return []


class NgramProposer(Proposer):
    """Prompt-lookup drafts: what followed the latest earlier occurrence of the last n tokens."""

    def __init__(self, spec):
        self.spec = spec
        self.num_speculative_tokens = spec.num_speculative_tokens

    def propose(self, out):
        s = self.spec
        for r in out.requests:
            r.drafts = ngram_lookup(r.all_ids, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max)
            r.draft_probs = None
