"""Mixture-of-experts routing of DeepSeek-V3 and GLM-4.5 (pure torch: the engine and the trainer share it).

A token's router logits go through a sigmoid. The experts are *chosen* on the scores plus a
per-expert correction bias (DeepSeek-V3's auxiliary-loss-free balancing: the bias steers load,
it never scales an output), optionally limited to the best `topk_group` of `n_group` expert
groups, a group ranked by the sum of its two best biased scores. The chosen experts' *weights*
come from the unbiased scores, normalised to sum to one when `norm_topk_prob`, then multiplied
by `routed_scaling_factor`.

Between optimiser steps the bias moves by a fixed rate towards balance (`update_expert_bias`):
up for experts that got fewer tokens than the mean, down for those that got more.
"""
import torch


def group_limited_mask(biased_scores, n_group, topk_group):
    """[T, E] bool: the experts of each token's best `topk_group` groups (all experts when n_group is 1)."""
    tokens, experts = biased_scores.shape
    if n_group <= 1:
        return torch.ones_like(biased_scores, dtype=torch.bool)
    grouped = biased_scores.view(tokens, n_group, experts // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
    best_groups = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros(tokens, n_group, dtype=torch.bool, device=biased_scores.device)
    keep.scatter_(1, best_groups, True)
    return keep.repeat_interleave(experts // n_group, dim=1)


def route(router_logits, correction_bias, moe):
    """(weights [T, k] fp32, expert indices [T, k]) of router logits [T, E] under `moe`
    (an object with num_experts_per_tok, n_group, topk_group, norm_topk_prob, routed_scaling_factor)."""
    scores = router_logits.float().sigmoid()
    biased = scores + correction_bias.float()
    allowed = group_limited_mask(biased, moe.n_group, moe.topk_group)
    chosen = biased.masked_fill(~allowed, float("-inf")).topk(moe.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, chosen)
    if moe.norm_topk_prob:
        # the epsilon keeps an all-zero row finite; it is the references' (transformers, vLLM)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, chosen


def tokens_per_expert(indices, num_experts):
    """[E] how many (token, slot) pairs each expert received."""
    return torch.bincount(indices.reshape(-1), minlength=num_experts)


def update_expert_bias(bias, load, rate):
    """Auxiliary-loss-free balancing, in place: bias += rate * sign(mean load - load)."""
    load = load.float()
    bias.add_(rate * torch.sign(load.mean() - load))
    return bias
