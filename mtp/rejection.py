"""Verification of drafted tokens: exact rejection sampling (pure torch).

Given the target's log-probs at the 1+k verify positions of each request, the drafts and
(optionally) the draft distribution q, decide how many drafts each request keeps and the
one extra token it emits (the correction at the first rejection, or the bonus token after
k acceptances). Methods:
  probabilistic  accept d with prob min(1, p(d)/q(d)); on rejection sample from
                 normalize(max(p - q, 0)). Without q the proposer is deterministic
                 (q = one-hot(d)), so the test is u < p(d) and the residual is p without d.
  strict         sample x ~ p at each position; accept iff d == x; emit x at the first
                 rejection. Exact for any proposer; ignores q.
  synthetic      accept the draft at position i with a set conditional probability
                 (one rate, or one per position) regardless of p, at any temperature;
                 the extra token is argmax p (greedy) or a sample from p. LOSSY, for
                 benchmarks only (the output is not the target distribution).
Otherwise greedy requests accept iff d == argmax p, and emit argmax p.
All of this arithmetic is fp32 whatever the model's dtype (a bf16 model's log-probs and q are
cast first), so --bf16 changes the distributions compared, never how they are compared.
A plain decode step is k = 0: no drafts, the emitted token is a sample from p.

Uniforms come as [B, k+2]: column i decides verify position i, the last column is for a
residual draw. A token sampled from p at position i (strict's samples, and probabilistic's
bonus token after every draft was kept) uses column i, so a step that drafts nothing samples
with column 0 in every method: the engine keys that column to the output position, which is
what lets strict speculation reproduce plain sampling token for token.
"""
from dataclasses import dataclass

import torch

from mtp.sampling import sample_with_uniforms

REJECTION_METHODS = ("strict", "probabilistic", "synthetic")


@dataclass
class VerifyResult:
    """Outcome of one verify step for a batch: how many drafts each request keeps and the tokens it emits."""

    num_accepted: torch.Tensor  # [B] drafts kept per request
    emitted: torch.Tensor  # [B, k+1] tokens; row b uses the first num_accepted[b]+1
    emitted_logprobs: torch.Tensor  # [B, k+1] target log-prob of each emitted token
    accepted_mask: torch.Tensor  # [B, k] position i kept (cumulative)


def _first_rejection(accept, draft_counts):
    """Number of leading accepted drafts per row, never more than the row's draft count."""
    k = accept.shape[1]
    in_range = torch.arange(k, device=accept.device)[None, :] < draft_counts[:, None]
    kept = torch.cumprod((accept & in_range).long(), dim=1)
    return kept.sum(1), kept.bool()


def _row_select(x, idx):
    """x[b, idx[b]] for x [B, P, ...]."""
    return x[torch.arange(x.shape[0], device=x.device), idx]


def synthetic_rates(rates, k, device):
    """[k] conditional acceptance per position from one number or a per-position sequence
    (positions past the sequence reuse its last entry)."""
    if isinstance(rates, (int, float)):
        return torch.full((k,), float(rates), device=device)
    rates = list(rates) or [0.0]
    return torch.tensor([rates[min(i, len(rates) - 1)] for i in range(k)], dtype=torch.float32, device=device)


def verify(target_logprobs, drafts, draft_counts, uniforms, greedy, method="probabilistic",
           draft_probs=None, synthetic_acceptance_rates=None):
    """target_logprobs [B, k+1, V]; drafts [B, k]; draft_counts [B]; uniforms [B, k+2] in [0,1)
    (drawn for synthetic verification even when greedy). synthetic_acceptance_rates: one
    conditional rate or one per draft position."""
    b, k1, _ = target_logprobs.shape
    k = k1 - 1
    # the accept test and the residual run in fp32 whatever the model's dtype: bf16 probabilities
    # (8 significant bits) would shift every acceptance probability and the residual distribution
    target_logprobs = target_logprobs.float()
    draft_probs = draft_probs.float() if draft_probs is not None else None
    probs = target_logprobs.exp()
    if method == "synthetic":
        accept = uniforms[:, :k] < synthetic_rates(synthetic_acceptance_rates, k, uniforms.device)[None, :]
        n_acc, kept = _first_rejection(accept, draft_counts)
        p = _row_select(probs, n_acc)
        extra = p.argmax(-1) if greedy else sample_with_uniforms(p, uniforms[:, -1])
    elif greedy:
        target = probs.argmax(-1)
        accept = drafts == target[:, :k]
        n_acc, kept = _first_rejection(accept, draft_counts)
        extra = _row_select(target, n_acc)
    elif method == "strict":
        flat_u = uniforms[:, :k1].reshape(-1)
        target = sample_with_uniforms(probs.reshape(b * k1, -1), flat_u).view(b, k1)
        n_acc, kept = _first_rejection(drafts == target[:, :k], draft_counts)
        extra = _row_select(target, n_acc)
    else:
        p_draft = probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        q_draft = (draft_probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
                   if draft_probs is not None else torch.ones_like(p_draft))
        accept = uniforms[:, :k] * q_draft < p_draft
        n_acc, kept = _first_rejection(accept, draft_counts)
        # a bonus token (every draft kept) meets its own position's uniform, unused by the tests
        # above (they read columns < n_acc); a correction after a rejection meets the residual one
        u_extra = torch.where(n_acc < draft_counts, uniforms[:, -1], _row_select(uniforms, n_acc))
        extra = _residual_sample(probs, drafts, draft_probs, n_acc, draft_counts, u_extra)
    emitted = torch.cat([torch.where(kept, drafts, torch.zeros_like(drafts)), torch.zeros_like(extra)[:, None]], 1)
    emitted[torch.arange(b), n_acc] = extra
    emitted_lp = target_logprobs.gather(-1, emitted.unsqueeze(-1)).squeeze(-1)
    return VerifyResult(n_acc, emitted, emitted_lp, kept)


def _residual_sample(probs, drafts, draft_probs, n_acc, draft_counts, u):
    """Sample the token after the kept drafts: from max(p - q, 0) at a rejection, from p after all."""
    p = _row_select(probs, n_acc)
    rejected = n_acc < draft_counts
    if draft_probs is not None:
        q = _row_select(draft_probs, n_acc.clamp(max=draft_probs.shape[1] - 1)) if draft_probs.shape[1] else torch.zeros_like(p)
    elif drafts.shape[1]:
        q = torch.nn.functional.one_hot(_row_select(drafts, n_acc.clamp(max=drafts.shape[1] - 1)), p.shape[-1]).to(p.dtype)
    else:
        q = torch.zeros_like(p)
    residual = torch.where(rejected[:, None], (p - q).clamp(min=0), p)
    # p == q exactly can leave nothing; then every token was equally fine: fall back to p
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    return sample_with_uniforms(residual, u)
