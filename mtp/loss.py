"""The MTP loss: depth-d cross-entropy, masked where both input and label are trained tokens.

At position t, depth d (1-based) reads the hidden state at t and token t+d and predicts
token t+d+1. A position counts only when the loss mask is on at t+d (the token fed in)
and at t+d+1 (the label), so prompt tokens and anything past the response never count.
"""
import torch
import torch.nn.functional as F


def mtp_loss_mask(loss_mask, depth):
    """[B, S-depth-1] mask for depth `depth`: m(t+depth) * m(t+depth+1)."""
    s = loss_mask.shape[1]
    return loss_mask[:, depth:s - 1] * loss_mask[:, depth + 1:]


def mtp_loss(logits, tokens, loss_mask, depth):
    """Token-mean CE of depth-`depth` logits [B, S', V] (S' >= S-depth-1) against token t+depth+1."""
    labels = tokens[:, depth + 1:]
    width = labels.shape[1]
    mask = mtp_loss_mask(loss_mask, depth).to(logits.dtype)
    ce = F.cross_entropy(logits[:, :width].transpose(1, 2).float(), labels, reduction="none")
    return (ce * mask).sum() / mask.sum().clamp(min=1.0)


def scaled_mtp_loss(per_depth_losses, scaling_factor):
    """factor / num_layers * sum of the per-depth losses (Megatron's convention)."""
    if not per_depth_losses:
        return torch.zeros(())
    return scaling_factor / len(per_depth_losses) * torch.stack(list(per_depth_losses)).sum()
