"""Parallel layouts of the trainer over gloo processes compute what one rank computes: TP=2 gives the
TP=1 losses and a TP=2 checkpoint loads at TP=1; on the MoE models expert parallelism (EP, ETP) gives
one rank's losses, grad norms and full per-expert weights, replays routes as one rank does, and its
checkpoints resume on one rank and back."""
import functools
import os

import pytest
import torch
import torch.multiprocessing as mp

from vime.models.families import MTP_FAMILIES
from vime.models.hf_format import read_config
from trainer.batch import build_batch
from trainer.config import TrainerConfig
from vime.net import free_port
from trainer.trainer import Trainer
from fp32_bounds import FP32_UNIT_ROUNDOFF, close, longest_reduction, probable_reduction_rtol, reduction_rtol
from trainer_fixtures import TINY, make_batch, make_tiny
from trainer_tp_worker import routed_samples, run_layout, run_tp2

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


# ---------------------------------------------------------------- expert parallelism (MoE)
# the shipped MoE checkpoints: GLM-4.5 (GQA) and DeepSeek-V3 (multi-latent attention), each with an MTP
# layer whose decoder layer is a MoE layer too (its experts are split like the trunk's)
MOE_CHECKPOINTS = {"glm4_moe": os.path.join(REPO, "checkpoints", "tiny-glm4-moe-mtp"),
                   "deepseek_v3": os.path.join(REPO, "checkpoints", "tiny-deepseek-v3-mtp")}
# (TrainerConfig's parallel sizes, trainer ranks): EP and ETP inside the data-parallel ranks, as megatron lays them
EP_LAYOUTS = {
    "ep2": ({"expert_model_parallel_size": 2}, 2),
    "etp2": ({"expert_tensor_parallel_size": 2}, 2),
    "ep2xetp2": ({"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 2}, 4),
}
# 4 samples: 2 micro-batches on one rank, one per rank at DP 2 (whose experts see both ranks' tokens)
MOE_KEYS = ("train/policy_loss", "train/mtp_loss", "train/grad_norm", "train/mtp_grad_norm", "train/entropy",
            "train/logprob_abs_diff")


def moe_rtol(hf):
    """What the layout's reduction order may change: a forward's, backward's and norm's chains through
    every layer and the MTP layer, over the model's longest sum (probable_reduction_rtol: <= 1e-4 here)."""
    cfg = read_config(hf)
    depth = 3 * 2 * 2 * (cfg.num_hidden_layers + cfg.num_nextn_predict_layers) + 4
    return probable_reduction_rtol(longest_reduction(cfg, cfg.max_position_embeddings), depth)


def spawn_layout(tmp_path, hf, layout, world, seeds, ckpt=None, load=None, samples=None, cfg=CFG):
    out = str(tmp_path / "layout.pt")
    mp.spawn(run_layout, args=(world, free_port(), layout, hf, ckpt, out, cfg, seeds, samples, load),
             nprocs=world, join=True)
    return torch.load(out)


def assert_trains_like_one_rank(layout_run, one, hf, world, seeds, first_batch, cfg=CFG):
    """The layout's log-probs (rank 0's rows), step metrics and full weights against the one-rank trainer's."""
    rtol = moe_rtol(hf)
    assert rtol <= 1e-4
    lp1 = one.compute_logprobs(first_batch)[0::world]  # rank 0's data-parallel rows (trainer_tp_worker.dp_share)
    lp = layout_run["logprobs"]
    assert (lp1[:, :lp.shape[1]] - lp).abs().max().item() <= rtol * lp1.abs().max().item()
    for s, theirs in zip(seeds, layout_run["metrics"]):
        ours = one.train_step(first_batch if s == seeds[0] else make_batch(seed=s))
        for k in MOE_KEYS + (("train/route_disagreement",) if "train/route_disagreement" in theirs else ()):
            assert close(ours[k], theirs[k], rtol), (s, k, ours[k], theirs[k])
    weights = dict(one.named_hf_weights())
    assert set(weights) == set(layout_run["weights"])  # every expert, trunk and MTP layer, under its HF name
    atol = len(seeds) * cfg["lr"] * rtol
    for n, w in weights.items():
        assert (w - layout_run["weights"][n]).abs().max().item() <= atol + 4 * FP32_UNIT_ROUNDOFF * w.abs().max().item(), n
    return weights


def assert_expert_layout_trains_like_one_rank_and_resumes_on_one(tmp_path, family, layout_name):
    hf = MOE_CHECKPOINTS[family]
    layout, world = EP_LAYOUTS[layout_name]
    ckpt = str(tmp_path / "ckpt")
    run = spawn_layout(tmp_path, hf, layout, world, SEEDS[:1], ckpt=ckpt)
    one = Trainer(TrainerConfig(**CFG), hf)
    assert_trains_like_one_rank(run, one, hf, world, SEEDS[:1], make_batch(seed=SEEDS[0]))

    # its torch_dist checkpoint holds every expert under its global id: one rank loads the very weights
    resumed = Trainer(TrainerConfig(**CFG), hf, load=ckpt)
    assert all(torch.equal(w, run["weights"][n]) for n, w in resumed.named_hf_weights())
    nxt_resumed, nxt_one = resumed.train_step(make_batch(seed=7)), one.train_step(make_batch(seed=7))
    for k in ("train/policy_loss", "train/mtp_loss"):
        assert close(nxt_resumed[k], nxt_one[k], moe_rtol(hf)), k


def test_ep2_trains_the_moe_model_like_one_rank_and_its_checkpoint_resumes_on_one(tmp_path):
    """GLM-4.5 MoE with its MTP layer trained, the routed experts split over two expert-parallel ranks
    (tokens all-gathered over gloo): step-0 log-probs, losses, entropy and grad norms, and the full
    per-expert weights it would push, equal one rank's; its checkpoint resumes on one rank."""
    assert_expert_layout_trains_like_one_rank_and_resumes_on_one(tmp_path, "glm4_moe", "ep2")


@pytest.mark.slow  # 20-60 s each on 2 cores
@pytest.mark.parametrize("family, layout_name", [(f, lay) for f in sorted(MOE_CHECKPOINTS) for lay in sorted(EP_LAYOUTS)
                                                 if (f, lay) != ("glm4_moe", "ep2")])
def test_every_expert_layout_trains_like_one_rank_and_resumes_on_one(tmp_path, family, layout_name):
    assert_expert_layout_trains_like_one_rank_and_resumes_on_one(tmp_path, family, layout_name)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(MOE_CHECKPOINTS))
def test_a_one_rank_checkpoint_resumes_at_ep2_like_one_rank(tmp_path, family):
    hf = MOE_CHECKPOINTS[family]
    one = Trainer(TrainerConfig(**CFG), hf)
    one.train_step(make_batch(seed=SEEDS[0]))
    ckpt = str(tmp_path / "one")
    one.save(ckpt)
    layout, world = EP_LAYOUTS["ep2"]
    run = spawn_layout(tmp_path, hf, layout, world, (7,), load=ckpt)
    rtol = moe_rtol(hf)
    ours = one.train_step(make_batch(seed=7))
    for k in ("train/policy_loss", "train/mtp_loss", "train/grad_norm"):
        assert close(ours[k], run["metrics"][0][k], rtol), k


@pytest.mark.slow
def test_routing_replay_at_ep2_replays_global_expert_ids_like_one_rank(tmp_path):
    """Random rollout routes (global expert ids) replayed at EP2: the same losses, grad norms and
    train/route_disagreement as one rank replaying them (whose routers take exactly those experts and
    whose MTP router routes by its own scores: test_routing_replay.py); replay changed the step (the
    same routes without replay give another policy loss)."""
    hf = MOE_CHECKPOINTS["glm4_moe"]
    cfg = read_config(hf)
    moe_layers = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    samples = functools.partial(routed_samples, moe_layers=moe_layers, k=cfg.moe.num_experts_per_tok,
                                num_experts=cfg.moe.n_routed_experts)
    replay = dict(CFG, use_rollout_routing_replay=True)
    layout, world = EP_LAYOUTS["ep2"]
    run = spawn_layout(tmp_path, hf, layout, world, SEEDS[:1], samples=samples, cfg=replay)
    assert run["metrics"][0]["train/route_disagreement"] > 0.5  # random sets: the trainer's own mostly differ
    batch = build_batch(samples(SEEDS[0]))
    assert_trains_like_one_rank(run, Trainer(TrainerConfig(**replay), hf), hf, world, SEEDS[:1], batch, replay)
    without = Trainer(TrainerConfig(**CFG), hf).train_step(batch)
    assert not close(without["train/policy_loss"], run["metrics"][0]["train/policy_loss"], 100 * moe_rtol(hf))
