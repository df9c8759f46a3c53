"""MTP draft losses (mtp/loss.py) against direct per-position formulas."""
import math

import pytest
import torch

from mtp.loss import (MTP_LOSSES, distill_target, mtp_ce_at_trained_positions, mtp_loss, mtp_loss_mask,
                      shift_to_predicted)

B, S, V = 2, 9, 7


def case(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, S), generator=g)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.float32)
    draft = torch.randn(B, S, V, generator=g) * 2
    policy = torch.randn(B, S, V, generator=g) * 2
    return tokens, loss_mask, draft, policy


def softmax_row(logits, temperature):
    w = [math.exp(x / temperature) for x in logits]
    return [x / sum(w) for x in w]


def top_k_row(probs, k):
    """Keep the k largest probabilities (ties at the k-th kept) and renormalise."""
    if not k:
        return probs
    kth = sorted(probs, reverse=True)[k - 1]
    kept = [p if p >= kth else 0.0 for p in probs]
    return [p / sum(kept) for p in kept]


def direct_loss(loss_type, draft, policy, tokens, loss_mask, depth, temperature, topk):
    """Loop over positions: at t, depth d predicts token t+d+1 whose policy distribution is
    the policy's next-token distribution at position t+d."""
    total, count = 0.0, 0.0
    for b in range(B):
        for t in range(S - depth - 1):
            m = float(loss_mask[b, t + depth] * loss_mask[b, t + depth + 1])
            if not m:
                continue
            label = int(tokens[b, t + depth + 1])
            p = top_k_row(softmax_row(policy[b, t + depth].tolist(), temperature), topk)
            if loss_type == "ce":
                term = -math.log(softmax_row(draft[b, t].tolist(), 1.0)[label])
            else:
                q = softmax_row(draft[b, t].tolist(), temperature)
                if loss_type == "soft_ce":
                    term = -sum(pi * math.log(qi) for pi, qi in zip(p, q) if pi > 0)
                else:
                    term = 0.5 * sum(abs(pi - qi) for pi, qi in zip(p, q))
            total, count = total + term, count + 1
    return total / count


@pytest.mark.parametrize("loss_type", sorted(MTP_LOSSES))
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("temperature, topk", [(1.0, 0), (0.7, 0), (0.7, 3), (1.0, 1)])
def test_each_loss_equals_its_direct_formula(loss_type, depth, temperature, topk):
    tokens, loss_mask, draft, policy = case(seed=depth)
    got = mtp_loss(draft, tokens, loss_mask, depth, loss_type, policy, temperature, topk).item()
    want = direct_loss(loss_type, draft.double(), policy.double(), tokens, loss_mask, depth, temperature, topk)
    # fp32 softmax / log-softmax of V terms vs a float64 loop: a few V*u relative per term
    assert got == pytest.approx(want, rel=1e-5 * V, abs=1e-6)


def test_target_is_the_policy_distribution_of_the_predicted_token():
    policy = torch.randn(B, S, V)
    for depth in (1, 2, 3):
        shifted = shift_to_predicted(policy, depth)
        for t in range(S - depth - 1):
            # depth d at t predicts token t+d+1, which the policy predicts at t+d
            assert torch.equal(shifted[:, t], policy[:, t + depth])


def test_soft_ce_with_a_one_hot_target_equals_ce():
    tokens, loss_mask, draft, _ = case()
    # a policy whose next-token distribution is (numerically) one-hot on the sampled token
    one_hot = torch.full((B, S, V), -1e4)
    one_hot[:, :-1].scatter_(-1, tokens[:, 1:, None], 0.0)
    for depth in (1, 2):
        ce = mtp_loss(draft, tokens, loss_mask, depth, "ce")
        soft = mtp_loss(draft, tokens, loss_mask, depth, "soft_ce", one_hot, 1.0)
        assert soft.item() == pytest.approx(ce.item(), rel=1e-6)


def test_top_1_soft_ce_is_ce_against_the_policy_argmax():
    tokens, loss_mask, draft, policy = case()
    argmax_tokens = tokens.clone()
    argmax_tokens[:, 1:] = policy[:, :-1].argmax(-1)  # token t+1 := the policy's mode at t
    got = mtp_loss(draft, tokens, loss_mask, 1, "soft_ce", policy, 1.0, topk=1)
    want = mtp_loss(draft, argmax_tokens, loss_mask, 1, "ce")
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


@pytest.mark.parametrize("temperature, topk", [(1.0, 0), (0.5, 0), (1.0, 3)])
def test_tv_is_zero_when_the_draft_equals_the_target_and_positive_otherwise(temperature, topk):
    tokens, loss_mask, _, policy = case()
    depth = 1
    aligned = shift_to_predicted(policy, depth)
    if topk:  # the draft equals the truncated target: logits -inf outside the top-k
        aligned = distill_target(aligned, 1.0, topk).log() * temperature
    assert mtp_loss(aligned, tokens, loss_mask, depth, "tv", policy, temperature, topk).item() <= 1e-6
    other = mtp_loss(torch.randn(B, S, V), tokens, loss_mask, depth, "tv", policy, temperature, topk).item()
    assert other > 0.05  # negative control


def test_distill_target_is_detached_normalised_and_top_k():
    logits = torch.randn(3, V, requires_grad=True)
    p = distill_target(logits, 0.8, topk=2)
    assert not p.requires_grad
    assert torch.allclose(p.sum(-1), torch.ones(3))
    assert ((p > 0).sum(-1) == 2).all()


def test_mask_is_shared_by_every_loss():
    tokens, loss_mask, draft, policy = case()
    for loss_type in MTP_LOSSES:
        # changing a draft row the mask excludes leaves the loss unchanged
        excluded = (mtp_loss_mask(loss_mask, 1) == 0).nonzero()[0]
        edited = draft.clone()
        edited[excluded[0], excluded[1]] += 5.0
        a = mtp_loss(draft, tokens, loss_mask, 1, loss_type, policy)
        b = mtp_loss(edited, tokens, loss_mask, 1, loss_type, policy)
        assert torch.equal(a, b)


@pytest.mark.parametrize("depth", [1, 2])
def test_the_head_applied_at_trained_positions_only_gives_the_hard_label_formula(depth):
    """The warm-up's loss projects only the counted positions; its value is the direct formula's on the full
    logits, and its gradient reaches only the positions that count."""
    tokens, loss_mask, _, _ = case(seed=depth)
    hidden = torch.randn(B, S, 5, generator=torch.Generator().manual_seed(7), requires_grad=True)
    head = torch.randn(V, 5, generator=torch.Generator().manual_seed(8))
    got = mtp_ce_at_trained_positions(hidden, lambda h: h @ head.t(), tokens, loss_mask, depth)
    logits = (hidden @ head.t()).detach().double()
    want = direct_loss("ce", logits, logits, tokens, loss_mask, depth, 1.0, 0)  # ce reads no policy
    assert got.item() == pytest.approx(want, rel=1e-5 * V, abs=1e-6)
    got.backward()
    counted = torch.zeros(B, S, dtype=torch.bool)
    counted[:, :S - depth - 1] = mtp_loss_mask(loss_mask, depth) > 0
    assert hidden.grad[~counted].abs().max() == 0 and (hidden.grad[counted].abs().sum(-1) > 0).all()


def test_no_counted_position_gives_a_zero_loss_as_mtp_loss_does():
    tokens, _, draft, _ = case()
    empty = torch.zeros(B, S)
    got = mtp_ce_at_trained_positions(draft.requires_grad_(), lambda h: h, tokens, empty, 1)
    assert got.item() == mtp_loss(draft, tokens, empty, 1).item() == 0.0
