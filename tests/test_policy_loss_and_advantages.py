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


def test_gspo_advantage_is_group_centred_and_std_normalised_and_ppo_without_a_critic_is_refused():
    r, g = [3.0, 1.0, 2.0, 0.0], [0, 0, 1, 1]
    # each group of two: mean in the middle, unbiased std |a - b| / sqrt(2) = sqrt(2) -> +-1/sqrt(2)
    half = 1 / math.sqrt(2)
    assert compute_advantages("gspo", r, g).tolist() == pytest.approx([half, -half, half, -half], rel=1e-5)
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


def gspo_by_hand(log_ratios, advantages, eps_low, eps_high):
    """GSPO's token-mean loss, its clip fraction and d loss / d log-prob per token, in python floats.
    Each sequence's importance ratio is exp(mean of its tokens' log ratios); every token of it takes
    -A * ratio, or -A * clip(ratio) where clipping makes that the larger (pessimistic) term; a clipped
    term has no gradient, an unclipped token's own log-prob carries -A * ratio (GSPO-token)."""
    tokens = sum(len(seq) for seq in log_ratios)
    loss, clipped, grads = 0.0, 0, []
    for seq, adv in zip(log_ratios, advantages):
        ratio = math.exp(sum(seq) / len(seq))
        unclipped = -adv * ratio
        clip_term = -adv * min(max(ratio, 1 - eps_low), 1 + eps_high)
        is_clipped = clip_term > unclipped
        loss += len(seq) * max(unclipped, clip_term)
        clipped += len(seq) * is_clipped
        grads.append([0.0 if is_clipped else -adv * ratio / tokens for _ in seq])
    return loss / tokens, clipped / tokens, grads


def test_gspo_loss_clips_the_sequence_ratio_and_takes_the_token_mean_as_computed_by_hand():
    """Sequence 0 (A = +1): token ratios e^.3, e^.1, e^.2 straddle 1.2, the sequence ratio e^.2 is
    clipped for all three tokens; sequence 1 (A = -0.5, one padding token) stays inside the clip range.
    Token-level PPO would clip only two tokens of sequence 0, so the value tells the ratios apart."""
    log_ratios = [[0.3, 0.1, 0.2], [-0.05, 0.01]]
    advantages = [1.0, -0.5]
    want_loss, want_clipfrac, want_grads = gspo_by_hand(log_ratios, advantages, 0.2, 0.2)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]])
    lp = (old + torch.tensor([[0.3, 0.1, 0.2], [-0.05, 0.01, 4.0]])).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor(advantages)[:, None].expand(2, 3)
    cfg = TrainerConfig(advantage_estimator="gspo", eps_clip=0.2, eps_clip_high=0.2)
    loss, metrics = policy_loss(lp, old, adv, mask, cfg)
    loss.backward()
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(want_clipfrac)
    assert lp.grad[0].tolist() == pytest.approx(want_grads[0], abs=1e-7)
    assert lp.grad[1, :2].tolist() == pytest.approx(want_grads[1], rel=1e-6)
    assert lp.grad[1, 2].item() == 0.0  # padding
