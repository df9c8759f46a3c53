"""Dynamic sampling (DAPO), GRPO groups spread over rollout engines, the rollout run one step
ahead of training (--async-rollout) with truncated importance sampling (--use-tis), and their bad inputs.

The pure parts are checked against direct formulas and bounds; two real train_rl.py runs (Ray,
megatron on gloo) check the trained batches themselves (pickled with --save-debug-rollout-data)."""
import glob
import os
import pickle
import random

import pytest
import torch

from rollout.group_batching import DynamicBatch, groups_of, has_signal, renumber, spread_groups
from tests.test_bad_inputs import args_for, ckpt, refused  # noqa: F401  (module fixture reused)
from tests.test_train_rl import base_args, metrics, run_train
from trainer.config import TrainerConfig
from trainer.losses import policy_loss, ppo_clip, token_mean
from vime.sample import Sample


def group(index, rewards, prompt_len=3):
    return [Sample(prompt_ids=[1] * prompt_len, index=index, sample_index=j, reward=r) for j, r in enumerate(rewards)]


# ------------------------------------------------------------------ groups over engines
@pytest.mark.parametrize("engines", [1, 2, 3])
def test_each_group_stays_on_one_engine_and_loads_are_within_lpt_bound(engines):
    rng = random.Random(engines)
    groups = [group(i, [0.0] * 4, prompt_len=rng.randint(1, 30)) for i in range(11)]
    shards = spread_groups(groups, engines, max_new_tokens=8)
    assert sorted(id(s) for shard in shards for s in shard) == sorted(id(s) for g in groups for s in g)
    for g in groups:  # the whole group on one engine: its prompt is prefilled once
        assert sum(any(s in shard for s in g) for shard in shards) == 1
    loads = [sum(len(s.prompt_ids) + 8 for s in shard) for shard in shards]
    per_group = [sum(len(s.prompt_ids) + 8 for s in g) for g in groups]
    optimum_lower_bound = max(sum(per_group) / engines, max(per_group))
    assert max(loads) <= (4 / 3 - 1 / (3 * engines)) * optimum_lower_bound + 1e-9  # Graham's LPT bound


# ------------------------------------------------------------------ dynamic sampling
def test_groups_with_all_equal_rewards_have_no_grpo_signal():
    from rollout.advantages import compute_advantages

    for rewards in ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0]):
        adv = compute_advantages("grpo", rewards, [0, 0, 0])
        assert has_signal(group(0, rewards)) == bool(adv.abs().max() > 0)


def test_dynamic_batch_keeps_only_groups_with_signal_until_full():
    batch = DynamicBatch(target=3)
    batch.add([group(0, [1, 1]), group(1, [0, 1]), group(2, [0, 0])])
    assert not batch.full()
    batch.add([group(0, [1, 0]), group(1, [2, 2]), group(2, [0, 3])])
    assert batch.full()
    groups, filled = batch.batch()
    assert filled == 0 and len(groups) == 3 and all(has_signal(g) for g in groups)
    assert batch.kept_fraction() == 3 / 6
    flat = renumber(groups)
    assert [s.index for s in flat] == [0, 0, 1, 1, 2, 2]  # one advantage group per kept prompt
    assert [len(g) for g in groups_of(flat)] == [2, 2, 2]


def test_dynamic_batch_at_the_bound_fills_with_zero_signal_groups():
    batch = DynamicBatch(target=3)
    batch.add([group(0, [1, 1]), group(1, [0, 1]), group(2, [0, 0])])
    groups, filled = batch.batch()
    assert filled == 2 and len(groups) == 3
    assert [has_signal(g) for g in groups] == [True, False, False]


# ------------------------------------------------------------------ truncated importance sampling
def test_tis_weights_each_token_by_the_capped_old_over_rollout_ratio():
    cfg = TrainerConfig(eps_clip=0.2, tis_clip=2.0)
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(2, 5, generator=g) * 0.3 - 1).requires_grad_()
    old = lp.detach() + torch.randn(2, 5, generator=g) * 0.1
    rollout = old + torch.randn(2, 5, generator=g)  # some ratios far above the cap
    adv, mask = torch.randn(2, 5, generator=g), torch.tensor([[1.0] * 5, [1, 1, 1, 0, 0]])
    loss, m = policy_loss(lp, old, adv, mask, cfg, rollout_logprobs=rollout)
    # direct formula: -A * clip-PPO(pi / pi_old) * min(pi_old / pi_rollout, C), token mean
    ratio = torch.exp(lp.detach() - old)
    ppo = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    weight = torch.minimum(torch.exp(old - rollout), torch.tensor(2.0))
    expected = (ppo * weight * mask).sum() / mask.sum()
    assert torch.allclose(loss.detach(), expected, rtol=1e-6, atol=0)
    assert (torch.exp(old - rollout) > 2.0).any() and m["tis_clipfrac"] > 0
    loss.backward()  # the weight is a constant: the gradient is the PPO gradient times it
    lp2 = lp.detach().clone().requires_grad_()
    plain, _ = ppo_clip(lp2, old, adv, mask, 0.2, 0.2)
    token_mean(plain * weight, mask).backward()
    assert torch.allclose(lp.grad, lp2.grad, rtol=1e-6, atol=1e-9)


def test_tis_is_plain_ppo_when_the_rollout_ran_on_the_old_policy():
    cfg = TrainerConfig(eps_clip=0.2, tis_clip=2.0)
    lp, old = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.1, -1.8, -0.5]])
    adv, mask = torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3)
    with_tis, _ = policy_loss(lp, old, adv, mask, cfg, rollout_logprobs=old)
    without, _ = policy_loss(lp, old, adv, mask, cfg)
    assert torch.equal(with_tis, without)


# ------------------------------------------------------------------ bad inputs (before any actor)
@pytest.mark.parametrize("extra, needles", [
    (["--async-rollout", "--debug-rollout-only"], ["--async-rollout", "--debug-rollout-only"]),
    (["--async-rollout", "--debug-train-only", "--load-debug-rollout-data", "x"], ["--async-rollout", "--debug-train-only"]),
    (["--dynamic-sampling", "--dynamic-sampling-max-draws", 1, "--over-sampling-batch-size", 2],
     ["--dynamic-sampling-max-draws 1", "--over-sampling-batch-size 2", "--rollout-batch-size 4"]),
    (["--over-sampling-batch-size", 8], ["--over-sampling-batch-size", "--dynamic-sampling"]),
    (["--dynamic-sampling", "--n-samples-per-prompt", 1, "--global-batch-size", 4, "--micro-batch-size", 4],
     ["--n-samples-per-prompt >= 2"]),
    (["--tis-clip", 0.5], ["--tis-clip 0.5"]),
])
def test_off_policy_and_dynamic_sampling_bad_inputs_are_one_line(ckpt, tmp_path, extra, needles):  # noqa: F811
    refused(args_for(ckpt, tmp_path, *extra), *needles)


def test_async_rollout_with_debug_rollout_only_exits_2_with_one_line(ckpt, tmp_path):  # noqa: F811
    proc = run_train(*args_for(ckpt, tmp_path, "--async-rollout", "--debug-rollout-only"), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: --async-rollout"), proc.stderr


# ------------------------------------------------------------------ real runs
ODD_LABELS = "tests.rewards_for_tests:parity_reward_on_odd_labels"


def trained_batches(rollouts):
    return [pickle.load(open(f, "rb")) for f in sorted(glob.glob(os.path.join(rollouts, "step_*.pkl")))]


@pytest.fixture(scope="module")
def rl_ckpt(tmp_path_factory):
    from rollout.task import make_prompts, write_jsonl
    from rollout.tiny_model import make_random_checkpoint
    from tests.conftest import SMALL

    path = str(tmp_path_factory.mktemp("off_policy_ckpt"))
    make_random_checkpoint(path, seed=5, std=0.3, **SMALL)
    write_jsonl(make_prompts(64, seed=1), os.path.join(path, "train.jsonl"))
    return path


@pytest.mark.slow  # a whole run of its own (1-2 min on 2 cores)
def test_async_dynamic_run_trains_one_step_behind_on_groups_with_signal_only(rl_ckpt, tmp_path):
    out, rollouts = tmp_path / "out", tmp_path / "rollouts"
    args = base_args(rl_ckpt, out, 3, "--enable-mtp-training", "--mtp-num-layers", 1, "--async-rollout", "--use-tis",
                     "--dynamic-sampling", "--dynamic-sampling-max-draws", 8, "--check-weight-update-equal",
                     "--save-debug-rollout-data", rollouts)
    args[args.index("tests.rewards_for_tests:parity_reward")] = ODD_LABELS
    proc = run_train(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]  # the guard compared every tensor after every push
    rows = metrics(out)
    assert [r["rollout/weight_staleness"] for r in rows] == [0, 1, 1]  # step t+1 ran on the weights after t-1
    assert [r["rollout/draft_staleness"] for r in rows] == [0, 1, 1]
    # the rollout really sampled from older weights: the trainer's log-probs differ from the rollout's
    # after step 0 (equal weights agree to ~1e-6 in fp32), and TIS corrects for it
    assert rows[0]["train/logprob_abs_diff"] < 1e-4 < min(r["train/logprob_abs_diff"] for r in rows[1:])
    assert all(r["train/tis_weight"] > 0 for r in rows)
    for step, samples in enumerate(trained_batches(rollouts)):
        groups = groups_of(samples)
        assert len(groups) == 4 and all(len(g) == 4 for g in groups)
        assert all(len({s.reward for s in g}) > 1 for g in groups)  # no zero-signal group was trained on
        assert rows[step]["rollout/zero_signal_share"] == 0
        drawn = rows[step]["rollout/dynamic_sampling_drawn_groups"]
        assert rows[step]["rollout/dynamic_sampling_kept_fraction"] <= 1 and drawn >= 4


@pytest.mark.slow  # a whole run of its own (1-2 min on 2 cores)
def test_dynamic_sampling_at_its_bound_trains_a_full_batch_and_says_so_once(rl_ckpt, tmp_path):
    out, rollouts = tmp_path / "out", tmp_path / "rollouts"
    args = base_args(rl_ckpt, out, 2, "--dynamic-sampling", "--dynamic-sampling-max-draws", 1,
                     "--save-debug-rollout-data", rollouts)
    args[args.index("tests.rewards_for_tests:parity_reward")] = ODD_LABELS
    proc = run_train(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, batches = metrics(out), trained_batches(rollouts)
    zero = [sum(not has_signal(g) for g in groups_of(b)) for b in batches]
    assert sum(zero) > 0  # this reward leaves groups without signal (the control of the test above)
    assert [r["rollout/dynamic_sampling_filled_groups"] for r in rows] == zero
    assert [r["rollout/zero_signal_share"] for r in rows] == [z / 4 for z in zero]
    assert all(len(b) == 16 for b in batches)
    assert (proc.stdout + proc.stderr).count("dynamic sampling reached --dynamic-sampling-max-draws 1") == 1
