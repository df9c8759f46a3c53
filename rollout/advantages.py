"""Advantage estimators: a registry from `--advantage-estimator` to a pure function.

Each estimator maps rewards [N] and group ids [N] (samples of the same prompt share an id)
to one advantage per sample. The loss broadcasts it over the sample's response tokens.
- grpo: (r - group mean) / (group std + eps), std unbiased (torch.std) like GRPO/slime.
- gspo: the same group advantage; the sequence-level ratio lives in trainer/losses.py.
- reinforce_plus_plus: REINFORCE++ without critic: rewards whitened over the whole batch.
- ppo is refused: PPO's advantage is GAE over a learned critic, which vime does not have;
  answering it with the GRPO advantage would run a different algorithm under PPO's name.
"""
import torch

EPS = 1e-6


def group_normalized(rewards, group_ids, eps=EPS):
    out = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        sel = group_ids == g
        r = rewards[sel]
        std = r.std() if r.numel() > 1 else torch.zeros(())
        out[sel] = (r - r.mean()) / (std + eps)
    return out


def batch_whitened(rewards, group_ids, eps=EPS):
    std = rewards.std() if rewards.numel() > 1 else torch.zeros(())
    return (rewards - rewards.mean()) / (std + eps)


ADVANTAGE_ESTIMATORS = {
    "grpo": group_normalized,
    "gspo": group_normalized,
    "reinforce_plus_plus": batch_whitened,
}

REFUSED_ESTIMATORS = {
    "ppo": "needs a critic (value model) for its GAE advantage, which vime does not have; use grpo "
           "(the same PPO-clip loss with a group-normalised advantage, no critic)",
}


def check_estimator(estimator):
    """One-line error for an `--advantage-estimator` vime refuses or does not know."""
    from vime.errors import UserError

    if estimator in REFUSED_ESTIMATORS:
        raise UserError(f"--advantage-estimator {estimator}: {REFUSED_ESTIMATORS[estimator]}")
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise UserError(f"--advantage-estimator {estimator!r}: choose one of {', '.join(sorted(ADVANTAGE_ESTIMATORS))}")


def compute_advantages(estimator, rewards, group_ids):
    """Advantages [N] of rewards [N] grouped by group_ids [N] under `estimator`."""
    check_estimator(estimator)
    return ADVANTAGE_ESTIMATORS[estimator](torch.as_tensor(rewards, dtype=torch.float32),
                                           torch.as_tensor(group_ids))


def assign_advantages(samples, estimator):
    """Set `sample.advantage` on every Sample (grouped by `sample.index`)."""
    adv = compute_advantages(estimator, [s.reward for s in samples], [s.index for s in samples])
    for sample, a in zip(samples, adv.tolist()):
        sample.advantage = a
    return samples
