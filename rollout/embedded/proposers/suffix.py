"""Suffix-decoding proposer: frequency-weighted continuation of the longest matching suffix.

The corpus a request speculates from is its own prompt + output so far and the finished
responses to the same prompt generated earlier in this process (the n samples of one
prompt repeat each other). For the current context we find the deepest match of its
suffix (at most max_tree_depth tokens) in that corpus; all occurrences of that suffix form
the tree node, and the draft walks down greedily to the most frequent next token while the
product of the empirical branch frequencies stays >= min_token_prob. The draft length is
bounded by num_speculative_tokens, max_spec_factor x match length and max_tree_depth minus
the match length, so short (unreliable) matches speculate little. Deterministic (no q).
"""
from collections import Counter, OrderedDict

from rollout.embedded.proposers import Proposer


def match_length(seq, end, ctx, limit):
    """How many tokens before seq[end] equal the last tokens of ctx (at most limit)."""
    m = 0
    while m < limit and m < end and seq[end - 1 - m] == ctx[-1 - m]:
        m += 1
    return m


def deepest_matches(corpus, ctx, max_depth):
    """(depth, [(seq, end)]) of the occurrences whose preceding tokens match ctx deepest;
    `end` is where the continuation starts."""
    best, node = 0, []
    last = ctx[-1]
    for seq, stop in corpus:
        for end in range(1, stop):
            if seq[end - 1] != last:
                continue
            m = match_length(seq, end, ctx, max_depth)
            if m > best:
                best, node = m, [(seq, end)]
            elif m == best:
                node.append((seq, end))
    return best, node


def walk(node, limit, min_prob):
    """Greedy most-frequent path below a node while its estimated probability >= min_prob."""
    draft, prob = [], 1.0
    while len(draft) < limit:
        d = len(draft)
        counts = Counter(seq[end + d] for seq, end in node if end + d < len(seq))
        if not counts:
            break
        tok, c = counts.most_common(1)[0]
        prob *= c / sum(counts.values())
        if prob < min_prob:
            break
        draft.append(tok)
        node = [(seq, end) for seq, end in node if end + d < len(seq) and seq[end + d] == tok]
    return draft


def suffix_draft(ctx, earlier, k, max_depth, spec_factor, min_prob):
    """Draft for context ctx given earlier full sequences of the same prompt."""
    corpus = [(ctx, len(ctx))] + [(seq, len(seq)) for seq in earlier]
    depth, node = deepest_matches(corpus, ctx, max_depth)
    if depth == 0:
        return []
    limit = min(k, int(spec_factor * depth), max_depth - depth)
    return walk(node, limit, min_prob)


class SuffixProposer(Proposer):
    """Suffix-decoding drafts from this request's text and earlier responses to the same prompt."""

    remembers_outputs = True

    def __init__(self, spec):
        self.spec = spec
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.responses = OrderedDict()  # prompt ids -> finished sequences, oldest first
        self.num_cached = 0

    def propose(self, out):
        s = self.spec
        for r in out.requests:
            earlier = self.responses.get(tuple(r.sample.prompt_ids), ())
            r.drafts = suffix_draft(r.all_ids, earlier, s.num_speculative_tokens, s.suffix_decoding_max_tree_depth,
                                    s.suffix_decoding_max_spec_factor, s.suffix_decoding_min_token_prob)
            r.draft_probs = None

    def release(self, request):
        limit = self.spec.suffix_decoding_max_cached_requests
        if limit == 0:
            return
        key = tuple(request.sample.prompt_ids)
        self.responses.setdefault(key, []).append(request.all_ids)
        self.responses.move_to_end(key)
        self.num_cached += 1
        while self.num_cached > limit:
            oldest = next(iter(self.responses))
            self.responses[oldest].pop(0)
            self.num_cached -= 1
            if not self.responses[oldest]:
                del self.responses[oldest]
