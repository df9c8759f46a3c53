"""TP=2 over two gloo processes gives the TP=1 losses; a TP=2 checkpoint loads at TP=1."""
import torch
import torch.multiprocessing as mp

from trainer.config import TrainerConfig
from trainer.distributed import free_port
from trainer.trainer import Trainer
from trainer_fixtures import make_batch, make_tiny
from trainer_tp_worker import run_tp2

CFG = dict(lr=1e-2, enable_mtp_training=True, micro_batch_size=2, clip_grad=0.5, mtp_clip_grad=0.05)
SEEDS = (0, 1)
KEYS = ("train/policy_loss", "train/mtp_loss", "train/mtp_1_loss", "train/grad_norm", "train/mtp_grad_norm",
        "train/entropy", "train/clipfrac", "train/logprob_abs_diff")


def test_tp2_matches_tp1_losses_and_its_checkpoint_loads_at_tp1(tmp_path):
    hf, ckpt, out = str(tmp_path / "hf"), str(tmp_path / "ckpt_tp2"), str(tmp_path / "tp2.pt")
    make_tiny(hf, seed=5, tie_word_embeddings=False)
    mp.spawn(run_tp2, args=(free_port(), hf, ckpt, out, CFG, SEEDS), nprocs=2, join=True)
    tp2 = torch.load(out)

    tp1 = Trainer(TrainerConfig(**CFG), hf)
    lp1 = tp1.compute_logprobs(make_batch(seed=SEEDS[0]))
    assert (lp1 - tp2["logprobs"]).abs().max().item() <= 1e-5
    metrics1 = [tp1.train_step(make_batch(seed=s)) for s in SEEDS]
    for m1, m2 in zip(metrics1, tp2["metrics"]):
        for k in KEYS:
            assert abs(m1[k] - m2[k]) <= 1e-5, (k, m1[k], m2[k])
    assert metrics1[0]["train/grad_norm"] > CFG["clip_grad"]  # clipping was exercised at both TP sizes

    weights1 = dict(tp1.named_hf_weights())
    assert set(weights1) == set(tp2["weights"])
    # after two AdamW steps: Adam's 1/sqrt(v) amplifies fp32 reduction-order differences a little
    assert max((weights1[n] - tp2["weights"][n]).abs().max().item() for n in weights1) <= 1e-4

    loaded = Trainer(TrainerConfig(**CFG), hf, load=ckpt)
    assert all(torch.equal(w, tp2["weights"][n]) for n, w in loaded.named_hf_weights())
    nxt_loaded = loaded.train_step(make_batch(seed=7))
    nxt_tp1 = tp1.train_step(make_batch(seed=7))
    for k in ("train/policy_loss", "train/mtp_loss"):
        assert abs(nxt_loaded[k] - nxt_tp1[k]) <= 1e-5
