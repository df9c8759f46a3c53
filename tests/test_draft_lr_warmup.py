"""The trained parts' learning-rate schedule (trainer/optimizer.py: megatron's OptimizerParamScheduler):
--draft-lr-warmup-iters against Adam stepped with the warm-up's rates written out, megatron's weight-decay groups,
and a checkpoint that resumes the warm-up where it stood."""
import pytest
import torch

from trainer.config import TrainerConfig
from trainer.trainer import Trainer
from trainer_fixtures import make_batch, make_tiny


def _part(model, lr, warmup, weight_decay=0.0):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trainer.distributed import ensure_distributed
    from trainer.optimizer import OptimizerOptions, TrainedPart

    ensure_distributed()
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, use_cpu_initialization=True)
    return TrainedPart(model, config, OptimizerOptions(), lr, weight_decay=weight_decay, adam_eps=1e-8, clip_grad=0,
                       lr_warmup_steps=warmup)


def _steps_against_adam(lr, warmup, rates):
    """The masters after 6 steps of a part with `warmup`, and of torch's AdamW stepped at `rates` (one per step)
    on the same gradients."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8, bias=False)
    ref = torch.nn.Parameter(model.weight.detach().clone())
    part = _part(model, lr, warmup)
    ref_opt = torch.optim.AdamW([ref], lr=lr, weight_decay=0.0)
    for rate in rates:
        x = torch.randn(4, 16)
        part.zero_grad()
        model(x).square().mean().backward()
        ref.grad = torch.autograd.grad(torch.nn.functional.linear(x, ref).square().mean(), ref)[0]
        part.finish_gradients()
        part.step()
        ref_opt.param_groups[0]["lr"] = rate
        ref_opt.step()
    return model.weight.detach(), ref.detach()


def test_the_warm_up_steps_at_rate_times_step_over_n_then_at_the_rate():
    """Step i (1-based) of a warm-up over N steps takes lr * min(i / N, 1): the same weights as torch's AdamW
    given those rates; the negative control, AdamW at the constant rate, ends elsewhere."""
    lr, n = 1e-2, 4
    warmed = [lr * min(i / n, 1.0) for i in range(1, 7)]
    got, ref = _steps_against_adam(lr, n, warmed)
    assert torch.equal(got, ref)
    got_constant, ref_constant = _steps_against_adam(lr, 0, [lr] * 6)
    assert torch.equal(got_constant, ref_constant)
    assert not torch.allclose(got, got_constant)


def test_weight_decay_follows_megatrons_groups_biases_undecayed():
    """With a zero gradient Adam's update is zero, so a step only decays: each matrix weight by lr * wd of itself
    (decoupled, as AdamW), the bias (a 1-D weight, megatron's wd_mult 0) not at all."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr, wd = 1e-2, 0.1
    part = _part(model, lr, 0, weight_decay=wd)
    part.zero_grad()
    (0.0 * model(torch.randn(2, 16)).sum()).backward()
    part.finish_gradients()
    part.step()
    # one fp32 multiply each side: they differ by at most an ulp (rel 2 ** -23 < 1.2e-7), bounded here by 1e-6
    torch.testing.assert_close(model.weight.detach(), before["weight"] * (1 - lr * wd), rtol=1e-6, atol=0)
    assert torch.equal(model.bias.detach(), before["bias"])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft_lr_warmup")
    make_tiny(path, seed=1, family="qwen3")
    return str(path)


def _largest_mtp_move(trainer):
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n.startswith("mtp.")}
    trainer.train_step(make_batch())
    return max((p.detach() - before[n]).abs().max().item() for n, p in trainer.model.named_parameters()
               if n in before)


def test_the_mtp_layers_first_step_moves_them_by_a_warm_ups_share_of_the_rate(hf_dir):
    """Adam's first step moves each weight by lr * |g| / (|g| + eps) <= lr, close to lr wherever |g| >> eps: with a
    warm-up over 4 steps the MTP layer's largest move is a quarter of the rate, without it (the control) the rate."""
    lr = 1e-3
    warm = _largest_mtp_move(Trainer(TrainerConfig(enable_mtp_training=True, draft_lr=lr, draft_lr_warmup_iters=4),
                                     hf_dir))
    full = _largest_mtp_move(Trainer(TrainerConfig(enable_mtp_training=True, draft_lr=lr), hf_dir))
    # fp32 weights near 1 (norms) round a move of lr / 4 by up to half an ulp of theirs
    ulp = torch.finfo(torch.float32).eps * 2
    assert lr / 4 * 0.9 < warm <= lr / 4 + ulp
    assert lr * 0.9 < full <= lr + ulp


def test_a_checkpoint_resumes_the_mtp_warm_up_where_it_stood(hf_dir, tmp_path):
    """Saved after 2 of 4 warm-up steps, the resumed trainer's next step takes 3/4 of the rate, as the original's;
    a checkpoint without optimizer steps (a fresh trainer's start) begins at 1/4."""
    lr = 1e-3
    cfg = TrainerConfig(enable_mtp_training=True, draft_lr=lr, draft_lr_warmup_iters=4)
    trainer = Trainer(cfg, hf_dir)
    reported = [trainer.train_step(make_batch(seed=seed))["train/mtp_lr"] for seed in (0, 1)]
    assert reported == pytest.approx([lr / 4, lr / 2], rel=1e-12)  # what wandb shows of each step
    trainer.save(str(tmp_path / "ckpt"))
    resumed = Trainer(cfg, hf_dir, load=str(tmp_path / "ckpt"))
    assert resumed.draft.part.learning_rate == trainer.draft.part.learning_rate == pytest.approx(3 * lr / 4,
                                                                                                 rel=1e-12)
    assert all(g["lr"] == pytest.approx(3 * lr / 4, rel=1e-12) for g in resumed.draft.part.optimizer.param_groups)
