"""Helpers the model-based proposers share: picking draft tokens from draft logits, padding.

A draft is either deterministic (argmax; the verifier then treats q as one-hot, which is
exact for any deterministic proposer) or sampled from q = the draft's distribution
processed exactly like the target's (temperature, top-k, top-p), in which case q is
returned so probabilistic verification can use min(1, p/q). Sampling pays off only with
`probabilistic` verification (strict ignores q and accepts a sampled draft less often than
the argmax), so proposers sample iff that is the rejection method and the request samples.
"""
import torch

from mtp.sampling import processed_logprobs, sample_with_uniforms


def samples_drafts(spec, sampling):
    return spec.rejection_sample_method == "probabilistic" and not sampling.greedy


def draft_uniforms(reqs, k):
    """[B, k] uniforms from each request's own generator (batch-independent draws)."""
    return torch.stack([r.uniforms(k) for r in reqs])


def pick_drafts(logits, sampling, uniforms=None):
    """logits [B, V] -> (tokens [B], q [B, V] or None). uniforms [B] means: sample from q."""
    if uniforms is None:
        return logits.argmax(-1), None
    q = processed_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p).exp()
    return sample_with_uniforms(q, uniforms.to(q.device)), q


def assign_drafts(reqs, tokens, probs):
    """tokens [B, k] (and probs [B, k, V] or None) -> request.drafts / request.draft_probs."""
    rows = tokens.tolist()
    for i, r in enumerate(reqs):
        r.drafts = rows[i]
        r.draft_probs = probs[i] if probs is not None else None


def pad_rows(rows, device, value=0):
    width = max(1, max(len(x) for x in rows))
    return torch.tensor([list(x) + [value] * (width - len(x)) for x in rows], dtype=torch.long, device=device)
