"""The policy loss (PPO-clip, optional KL to a reference) and its metrics (pure torch).

All per-token tensors are aligned with the labels: position j holds the log-prob of
token j+1 given tokens 0..j. Aggregation is a token mean over response tokens; passing
`num_tokens` (the count over the whole step) makes micro-batch losses add up to it.
With a sequence-level ratio (GSPO) every token of a sequence shares
exp(mean_t log ratio), with the per-token gradient of GSPO-token.
"""
import torch

from vime.errors import require

KL_ESTIMATORS = {
    # log_ratio = log pi(x) - log pi_ref(x), sampled from pi
    "k1": lambda log_ratio: log_ratio,
    "k3": lambda log_ratio: torch.exp(-log_ratio) - 1 + log_ratio,
}


def check_kl_estimator(name):
    """One-line error for a `--kl-loss-type` that is not in KL_ESTIMATORS."""
    require(name in KL_ESTIMATORS, f"--kl-loss-type {name!r}: choose one of {', '.join(sorted(KL_ESTIMATORS))}")

SEQUENCE_LEVEL_ESTIMATORS = ("gspo",)


def masked_sum(x, mask):
    return (x * mask).sum()


def token_mean(x, mask, num_tokens=None):
    """Sum over masked tokens / num_tokens (default: the masked count of this tensor)."""
    denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=x.dtype)
    return masked_sum(x, mask) / denom.clamp(min=1)


def sequence_log_ratio(log_ratio, mask):
    """GSPO: per-token log ratio replaced by its sequence mean, keeping per-token gradients."""
    seq = masked_sum_rows(log_ratio, mask) / mask.sum(-1, keepdim=True).clamp(min=1)
    return seq.detach() + log_ratio - log_ratio.detach()


def masked_sum_rows(x, mask):
    return (x * mask).sum(-1, keepdim=True)


def ppo_clip(logprobs, old_logprobs, advantages, mask, eps_clip, eps_clip_high, sequence_level=False):
    """Per-token PPO-clip loss and clipped indicator."""
    log_ratio = logprobs - old_logprobs
    if sequence_level:
        log_ratio = sequence_log_ratio(log_ratio, mask)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).to(logprobs.dtype)


def kl_penalty(logprobs, ref_logprobs, estimator):
    return KL_ESTIMATORS[estimator](logprobs - ref_logprobs)


def entropy_from_logits(logits, temperature):
    """Per-token entropy of softmax(logits / T), fp32."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def truncated_importance_weight(old_logprobs, rollout_logprobs, cap):
    """TIS: min(pi_old / pi_rollout, cap) per token, detached — the off-policy gap between the
    policy the rollout sampled from and the one the step starts from, truncated so that rare
    tokens cannot blow up the gradient (the PPO ratio then starts at 1 against pi_old)."""
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


def policy_loss(logprobs, old_logprobs, advantages, mask, cfg, ref_logprobs=None, num_tokens=None,
                rollout_logprobs=None):
    """(loss, metrics) of the policy objective. cfg: TrainerConfig (eps_clip*, KL, estimator, TIS).

    `old_logprobs` anchor the PPO ratio; given `rollout_logprobs` too (--use-tis, `old_logprobs`
    then recomputed by the trainer), each token's loss is weighted by the truncated importance weight."""
    pg, clipped = ppo_clip(logprobs, old_logprobs, advantages, mask, cfg.eps_clip, cfg.effective_eps_clip_high,
                           sequence_level=cfg.advantage_estimator in SEQUENCE_LEVEL_ESTIMATORS)
    metrics = {}
    if rollout_logprobs is not None:
        weight = truncated_importance_weight(old_logprobs, rollout_logprobs, cfg.tis_clip)
        pg = pg * weight
        metrics["tis_weight"] = token_mean(weight, mask, num_tokens).detach()
        metrics["tis_clipfrac"] = token_mean((weight >= cfg.tis_clip).to(pg.dtype), mask, num_tokens).detach()
    loss = token_mean(pg, mask, num_tokens)
    metrics.update({"pg_loss": loss.detach(), "clipfrac": token_mean(clipped, mask, num_tokens).detach()})
    if cfg.use_kl_loss:
        kl = token_mean(kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator), mask, num_tokens)
        loss = loss + cfg.kl_loss_coef * kl
        metrics["kl"] = kl.detach()
    return loss, metrics
