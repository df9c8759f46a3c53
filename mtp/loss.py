"""The MTP loss: depth-d draft loss, masked where both input and label are trained tokens.

At position t, depth d (1-based) reads the hidden state at t and token t+d and predicts
token t+d+1. A position counts only when the loss mask is on at t+d (the token fed in)
and at t+d+1 (the label), so prompt tokens and anything past the response never count.

Three per-position losses, picked by name from `MTP_LOSSES`:
- `ce`: cross-entropy against the sampled token t+d+1 (hard label).
- `soft_ce`: cross-entropy against the policy's own distribution of token t+d+1, i.e. its
  next-token distribution at position t+d (`shift_to_predicted`), detached.
- `tv`: total variation between that distribution and the draft's. Acceptance of a sampled
  draft is exactly 1 - TV, so this loss targets the acceptance itself.
The distillation losses read both distributions at the rollout temperature (the verifier
compares them there) and may truncate the target to its top-k, renormalised.
"""
import torch
import torch.nn.functional as F

from mtp.sampling import effective_temperature


def mtp_loss_mask(loss_mask, depth):
    """[B, S-depth-1] mask for depth `depth`: m(t+depth) * m(t+depth+1)."""
    s = loss_mask.shape[1]
    return loss_mask[:, depth:s - 1] * loss_mask[:, depth + 1:]


def shift_to_predicted(policy_logits, depth):
    """Policy logits [B, S, V] aligned with depth `depth`'s positions: row t is the policy's
    distribution of token t+depth+1, i.e. its next-token logits at position t+depth."""
    return policy_logits[:, depth:]


def distill_target(target_logits, temperature, topk=0):
    """Detached probs softmax(logits / T) [.., V], kept to the top-k and renormalised when topk > 0."""
    scaled = target_logits.detach().float() / effective_temperature(temperature)
    if topk and topk < scaled.shape[-1]:
        kth = torch.topk(scaled, topk, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def _hard_ce(draft_logits, labels, target_logits, temperature, topk):
    return F.cross_entropy(draft_logits.transpose(1, 2).float(), labels, reduction="none")


def _soft_ce(draft_logits, labels, target_logits, temperature, topk):
    target = distill_target(target_logits, temperature, topk)
    logq = torch.log_softmax(draft_logits.float() / effective_temperature(temperature), dim=-1)
    # where the truncated target is 0 the term is 0 even if log q is very negative
    return -(target * logq).where(target > 0, torch.zeros((), dtype=logq.dtype)).sum(-1)


def _total_variation(draft_logits, labels, target_logits, temperature, topk):
    target = distill_target(target_logits, temperature, topk)
    q = torch.softmax(draft_logits.float() / effective_temperature(temperature), dim=-1)
    return 0.5 * (q - target).abs().sum(-1)


# name -> per-position loss [B, W] of (draft logits [B, W, V], labels [B, W], target logits [B, W, V], T, topk)
MTP_LOSSES = {"ce": _hard_ce, "soft_ce": _soft_ce, "tv": _total_variation}
# the losses that read the policy's distribution (the others need no [B, S, V] policy logits kept)
DISTILLATION_LOSSES = frozenset({"soft_ce", "tv"})


def in_draft_vocabulary(target_ids, vocab_size, loss_type, labels, mask, target_logits=None):
    """(labels, mask, target logits) of a draft that predicts only the target tokens `target_ids` [N] of the
    target's `vocab_size`, for its logits over those N (EAGLE-3's reduced vocabulary): labels [B, W] become
    draft ids and, for a loss that reads them, a position whose label the draft cannot predict leaves the
    mask [B, W]; the policy's logits [B, W, V] are read at the draft's tokens, so its distribution is
    renormalised over them."""
    draft_id = torch.full((vocab_size,), -1, dtype=torch.long, device=labels.device)
    draft_id[target_ids] = torch.arange(len(target_ids), device=labels.device)
    mapped = draft_id[labels]
    if loss_type not in DISTILLATION_LOSSES:
        mask = mask * (mapped >= 0)
    gathered = target_logits.index_select(-1, target_ids) if target_logits is not None else None
    return mapped.clamp(min=0), mask, gathered  # a masked-out label reads draft id 0, counted nowhere


def mtp_loss(logits, tokens, loss_mask, depth, loss_type="ce", policy_logits=None, temperature=1.0, topk=0):
    """Token-mean loss of depth-`depth` logits [B, S', V] (S' >= S-depth-1) predicting token t+depth+1.

    policy_logits [B, S, V]: the policy's logits at every position (needed by the distillation
    losses; shifted here to the predicted position and detached)."""
    labels = tokens[:, depth + 1:]
    width = labels.shape[1]
    mask = mtp_loss_mask(loss_mask, depth).to(torch.float32)
    target = shift_to_predicted(policy_logits, depth)[:, :width] if policy_logits is not None else None
    per_position = MTP_LOSSES[loss_type](logits[:, :width], labels, target, temperature, topk)
    return (per_position * mask).sum() / mask.sum().clamp(min=1.0)


def mtp_ce_at_trained_positions(hidden, head, tokens, loss_mask, depth):
    """mtp_loss(head(hidden), tokens, loss_mask, depth) with the hard label, the vocabulary projection `head`
    applied only at the positions the mask counts. Same value; on a real vocabulary the projection is most of
    a depth's cost, and a chat prompt's positions never count."""
    labels = tokens[:, depth + 1:]
    keep = mtp_loss_mask(loss_mask, depth) > 0
    if not keep.any():
        return hidden.sum() * 0.0  # mtp_loss's 0 / clamp(0, 1), still on the graph
    return F.cross_entropy(head(hidden[:, :labels.shape[1]][keep]).float(), labels[keep])


def scaled_mtp_loss(per_depth_losses, scaling_factor):
    """factor / num_layers * sum of the per-depth losses (Megatron's convention)."""
    if not per_depth_losses:
        return torch.zeros(())
    return scaling_factor / len(per_depth_losses) * torch.stack(list(per_depth_losses)).sum()
