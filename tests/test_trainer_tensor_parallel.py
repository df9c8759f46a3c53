"""TP=2 over two gloo processes gives the TP=1 losses; a TP=2 checkpoint loads at TP=1."""
import pytest
import torch
import torch.multiprocessing as mp

from vime.models.families import MTP_FAMILIES
from trainer.config import TrainerConfig
from vime.net import free_port
from trainer.trainer import Trainer
from fp32_bounds import FP32_UNIT_ROUNDOFF, close, reduction_rtol
from trainer_fixtures import TINY, make_batch, make_tiny
from trainer_tp_worker import run_tp2

# adam_eps = lr: Adam's update lr*m/(sqrt(v)+eps) then changes by at most lr/eps = 1 times a change in
# the gradient, so TP's different fp32 reduction order is not amplified from one step to the next
# (with eps = 1e-8 a gradient near zero turns a rounding difference into a weight change 1e6x larger).
CFG = dict(lr=1e-2, adam_eps=1e-2, enable_mtp_training=True, micro_batch_size=2, clip_grad=0.5, draft_clip_grad=0.05)
SEEDS = (0, 1)
KEYS = ("train/policy_loss", "train/mtp_loss", "train/mtp_1_loss", "train/grad_norm", "train/mtp_grad_norm",
        "train/entropy", "train/clipfrac", "train/logprob_abs_diff")
# forward, backward and the norm each chain ~2 reductions per sub-layer; the longest is the MLP's
DEPTH = 3 * 2 * 2 * TINY["num_hidden_layers"] + 4
RTOL = reduction_rtol(TINY["intermediate_size"], DEPTH)
# a relative gradient error r moves Adam's update by lr*eps*r*|g|/(|g|+eps)^2 <= lr*r/4 per step
WEIGHT_ATOL = len(SEEDS) * CFG["lr"] * RTOL


@pytest.mark.parametrize("family", sorted(MTP_FAMILIES))  # MoE trains at TP 1 (test_trainer_moe.py)
def test_tp2_matches_tp1_losses_and_its_checkpoint_loads_at_tp1(tmp_path, family):
    hf, ckpt, out = str(tmp_path / "hf"), str(tmp_path / "ckpt_tp2"), str(tmp_path / "tp2.pt")
    make_tiny(hf, seed=5, tie_word_embeddings=False, family=family)
    mp.spawn(run_tp2, args=(free_port(), hf, ckpt, out, CFG, SEEDS), nprocs=2, join=True)
    tp2 = torch.load(out)

    tp1 = Trainer(TrainerConfig(**CFG), hf)
    lp1 = tp1.compute_logprobs(make_batch(seed=SEEDS[0]))
    assert (lp1 - tp2["logprobs"]).abs().max().item() <= RTOL * lp1.abs().max().item()
    metrics1 = [tp1.train_step(make_batch(seed=s)) for s in SEEDS]
    for m1, m2 in zip(metrics1, tp2["metrics"]):
        for k in KEYS:
            assert close(m1[k], m2[k], RTOL), (k, m1[k], m2[k])
    assert metrics1[0]["train/grad_norm"] > CFG["clip_grad"]  # clipping was exercised at both TP sizes

    weights1 = dict(tp1.named_hf_weights())
    assert set(weights1) == set(tp2["weights"])
    for n, w in weights1.items():
        assert (w - tp2["weights"][n]).abs().max().item() <= WEIGHT_ATOL + 4 * FP32_UNIT_ROUNDOFF * w.abs().max().item(), n

    loaded = Trainer(TrainerConfig(**CFG), hf, load=ckpt)
    assert all(torch.equal(w, tp2["weights"][n]) for n, w in loaded.named_hf_weights())
    nxt_loaded = loaded.train_step(make_batch(seed=7))
    nxt_tp1 = tp1.train_step(make_batch(seed=7))
    for k in ("train/policy_loss", "train/mtp_loss"):
        assert close(nxt_loaded[k], nxt_tp1[k], RTOL), k
