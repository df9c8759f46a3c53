"""Policy loss (PPO-clip, KL, GSPO ratio) and advantage estimators on hand-computed numbers."""
import math

import pytest
import torch

from rollout.advantages import assign_advantages, compute_advantages
from trainer.config import TrainerConfig
from trainer.losses import kl_penalty, policy_loss, ppo_clip, sequence_log_ratio, token_mean
from vime.errors import UserError
from vime.sample import Sample


def test_grpo_advantage_is_group_centred_and_std_normalised():
    adv = compute_advantages("grpo", [1.0, 0.0, 0.0, 1.0, 2.0, 2.0], [0, 0, 0, 0, 1, 1])
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1: all equal -> 0
    s = math.sqrt(1 / 3)
    assert torch.allclose(adv, torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.0, 0.0]), atol=1e-5)


def test_gspo_uses_the_grpo_group_advantage_and_ppo_without_a_critic_is_refused():
    r, g = [3.0, 1.0, 2.0, 0.0], [0, 0, 1, 1]
    expected = compute_advantages("grpo", r, g)
    assert torch.equal(compute_advantages("gspo", r, g), expected)
    with pytest.raises(UserError, match="needs a critic"):
        compute_advantages("ppo", r, g)


def test_reinforce_plus_plus_whitens_over_the_whole_batch():
    adv = compute_advantages("reinforce_plus_plus", [1.0, 2.0, 3.0, 6.0], [0, 0, 1, 1])
    mean, std = 3.0, math.sqrt(((4 + 1 + 0 + 9) / 3))
    assert torch.allclose(adv, (torch.tensor([1.0, 2.0, 3.0, 6.0]) - mean) / std, atol=1e-5)


def test_assign_advantages_groups_samples_by_prompt_index():
    samples = [Sample(prompt_ids=[1], index=i // 2, reward=r) for i, r in enumerate([1.0, 0.0, 5.0, 5.0])]
    assign_advantages(samples, "grpo")
    assert [round(s.advantage, 4) for s in samples] == [round(0.5 / math.sqrt(0.5), 4),
                                                        round(-0.5 / math.sqrt(0.5), 4), 0.0, 0.0]


def test_unknown_advantage_estimator_is_refused_in_one_line():
    with pytest.raises(UserError, match="--advantage-estimator"):
        compute_advantages("nope", [1.0], [0])


def test_ppo_clip_matches_hand_computed_values():
    old = torch.zeros(1, 3)
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, clipped = ppo_clip(lp, old, adv, torch.ones(1, 3), eps_clip=0.2, eps_clip_high=0.28)
    # token 0: ratio 1.5, A>0 -> min(1.5, 1.28) -> -1.28 (clipped); token 1: ratio 0.5, A>0 -> -0.5
    # token 2: ratio 1.1, A<0 -> max(1.1, 1.1) -> 1.1
    assert torch.allclose(loss, torch.tensor([[-1.28, -0.5, 1.1]]), atol=1e-6)
    assert clipped.tolist() == [[1.0, 0.0, 0.0]]


def test_policy_loss_is_a_token_mean_over_response_tokens_with_clipfrac():
    cfg = TrainerConfig(eps_clip=0.2)
    lp = torch.log(torch.tensor([[1.5, 1.0, 9.0]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # third token is padding: ignored
    loss, m = policy_loss(lp, torch.zeros(1, 3), torch.ones(1, 3), mask, cfg)
    assert loss.item() == pytest.approx((-1.2 - 1.0) / 2, abs=1e-6)
    assert m["clipfrac"].item() == pytest.approx(0.5)
    loss_n, _ = policy_loss(lp, torch.zeros(1, 3), torch.ones(1, 3), mask, cfg, num_tokens=4)
    assert loss_n.item() == pytest.approx((-1.2 - 1.0) / 4, abs=1e-6)


def test_kl_estimators_k1_and_k3():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))


def test_kl_loss_adds_coef_times_kl():
    cfg = TrainerConfig(use_kl_loss=True, kl_loss_coef=0.5, kl_estimator="k1")
    lp = torch.tensor([[math.log(0.5)]])
    loss, m = policy_loss(lp, lp, torch.zeros(1, 1), torch.ones(1, 1), cfg, ref_logprobs=lp - 1.0)
    assert m["kl"].item() == pytest.approx(1.0)
    assert loss.item() == pytest.approx(0.5)


def test_gspo_ratio_is_the_sequence_mean_with_token_gradients():
    log_ratio = torch.tensor([[0.2, 0.4, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    seq = sequence_log_ratio(log_ratio, mask)
    assert torch.allclose(seq[0, :2], torch.tensor([0.3, 0.3]))
    token_mean(seq, mask).backward()
    assert torch.allclose(log_ratio.grad, torch.tensor([[0.5, 0.5, 0.0]]))
