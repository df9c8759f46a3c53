"""Parallel layouts over gloo processes compute what one rank computes: TP=2, pipeline stages (PP=2, uneven
stages, TP=2 x PP=2) give one rank's log-probs, losses, grad norms and pushed weights, and a torch_dist
checkpoint moves between one rank and the layout in both directions (the resumed steps equal the
uninterrupted one-rank run's)."""
import os

import pytest
import torch
import torch.multiprocessing as mp

from vime.models.families import MTP_FAMILIES
from trainer.config import TrainerConfig
from vime.net import free_port
from trainer.trainer import Trainer
from fp32_bounds import FP32_UNIT_ROUNDOFF, close, reduction_rtol
from trainer_fixtures import TINY, make_batch, make_tiny
from trainer_tp_worker import run_layout
from vime.parallel_layout import ParallelLayout

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
    mp.spawn(run_layout, args=(ParallelLayout(tp=2), free_port(), hf, None, ckpt, out, CFG, SEEDS), nprocs=2, join=True)
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


# ---- pipeline stages ------------------------------------------------------------------------
CHECKPOINTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")


def weight_tensor_count(hf):
    from vime.models.hf_format import load_hf_checkpoint

    return len(load_hf_checkpoint(hf)[1])


def pipeline_rtol(hf, layout, steps):
    """Stages run the ops one rank runs on the same tensors, so their forward and backward reorder no
    fp32 sum; what they split is the grad norm's sum over weight tensors (one reduction per step, reaching
    the next steps through the clip coefficient), the first and last stage's word-embedding grads (two
    terms, summed on the wire instead of in autograd: exact) and, with TP, TP's own reductions (RTOL)."""
    rtol = reduction_rtol(weight_tensor_count(hf), steps + 1)
    return rtol + (RTOL_TP_PP if layout.tp > 1 else 0.0)


# TP x PP runs a model whose longest reduction keeps TP's bound (RTOL's derivation) within 1e-4
TP_PP_SHAPE = dict(intermediate_size=48)
RTOL_TP_PP = reduction_rtol(TP_PP_SHAPE["intermediate_size"], DEPTH)


def layout_checkpoint(model, tmp_path):
    """An HF checkpoint of `model`: a shipped one by name, else a tiny random one of that family."""
    if os.path.isdir(os.path.join(CHECKPOINTS, model)):
        return os.path.join(CHECKPOINTS, model)
    family, _, shape = model.partition(":")
    hf = str(tmp_path / "hf")
    make_tiny(hf, seed=5, tie_word_embeddings=False, family=family, **(TP_PP_SHAPE if shape == "tp_pp" else {}))
    return hf


def rollout_routes(hf):
    """make_batch's `routes` for the MoE checkpoint `hf`: its MoE layers, routed experts and top-k."""
    from vime.models.hf_format import read_config

    cfg = read_config(hf)
    moe_layers = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return {"routes": (moe_layers, cfg.moe.n_routed_experts, cfg.moe.num_experts_per_tok)}


SLOW = pytest.mark.slow  # each spawns its layout's processes: 30-60 s on 2 cores


def external_draft(kind):
    """Trainer options that train the shipped tiny Qwen2's external `kind` draft (it reads target layers
    of both stages of a 4 + 3 split), with a draft-only step on the updated policy."""
    from vime.spec_config import as_spec_config

    spec = as_spec_config({"method": kind, "model": os.path.join(CHECKPOINTS, f"tiny-qwen2-{kind}"),
                           "num_speculative_tokens": 3}, "embedded")
    return dict(enable_mtp_training=False, enable_draft_training=True, speculative_config=spec,
                draft_steps_per_rollout=2, draft_replay_batches=0)


@pytest.mark.parametrize("model, layout, warm, options", [
    # the shipped GLM-4.5 MoE (5 decoder layers + MTP): 3 + 2 layers, the MTP block and a copy of the
    # word embedding on the last stage, MoE routers and expert biases on both; each stage's routers
    # replay the rollout routes of their own layers (random ones: every router's choice changes the loss)
    pytest.param("tiny-glm4-moe-mtp", ParallelLayout(pp=2, last_stage_layers=2), 0,
                 {"use_rollout_routing_replay": True}, id="pp2-glm4-moe-replay"),
    pytest.param("tiny-deepseek-v3-mtp", ParallelLayout(pp=2, first_stage_layers=2), 1, {}, id="pp2-deepseek-v3",
                 marks=SLOW),
    pytest.param("mimo", ParallelLayout(pp=2), 1, {}, id="pp2-mimo", marks=SLOW),
    pytest.param("qwen3", ParallelLayout(pp=2), 1, {"mtp_detach_trunk": False}, id="pp2-qwen3-joint-mtp",
                 marks=SLOW),
    pytest.param("mimo:tp_pp", ParallelLayout(tp=2, pp=2), 1, {}, id="tp2-pp2-mimo", marks=SLOW),
    # the draft reads layers of both stages: they reach the last stage after the pipeline
    pytest.param("tiny-qwen2", ParallelLayout(pp=2, first_stage_layers=4), 1, external_draft("eagle3"),
                 id="pp2-eagle3"),
    pytest.param("tiny-qwen2", ParallelLayout(pp=2, first_stage_layers=4), 1, external_draft("dflash"),
                 id="pp2-dflash", marks=SLOW),
])
def test_pipeline_stages_train_like_one_rank_and_checkpoints_move_between_layouts(tmp_path, model, layout, warm,
                                                                                  options):
    hf = layout_checkpoint(model, tmp_path)
    one_ckpt, layout_ckpt, out = str(tmp_path / "one"), str(tmp_path / "layout"), str(tmp_path / "layout.pt")
    cfg = dict(CFG, **options)
    batch_kwargs = rollout_routes(hf) if cfg.get("use_rollout_routing_replay") else {}

    def batch(seed):
        return make_batch(seed=seed, **batch_kwargs)

    one = Trainer(TrainerConfig(**cfg), hf)
    for s in range(warm):  # the layout resumes a one-rank run after `warm` steps (0: at its step 0)
        one.train_step(batch(10 + s))
    one.save(one_ckpt)
    mp.spawn(run_layout, args=(layout, free_port(), hf, one_ckpt, layout_ckpt, out, cfg, SEEDS, batch_kwargs),
             nprocs=layout.world_size, join=True)
    got = torch.load(out)
    rtol = pipeline_rtol(hf, layout, warm + len(SEEDS) + 1)

    lp = one.compute_logprobs(batch(SEEDS[0]))
    assert (lp - got["logprobs"]).abs().max().item() <= rtol * lp.abs().max().item()
    for s, theirs in zip(SEEDS, got["metrics"]):  # the uninterrupted one-rank run's steps: every metric
        ours = one.train_step(batch(s))
        assert set(ours) == set(theirs)
        for k in ours:
            assert close(ours[k], theirs[k], rtol), (k, ours[k], theirs[k])
    assert got["metrics"][0]["train/grad_norm"] > CFG["clip_grad"]  # clipping was exercised in both

    weights = dict(one.named_hf_weights())  # what trainer rank 0 pushes: the whole model, names and values
    assert set(weights) == set(got["weights"])
    for n, w in weights.items():
        bound = len(SEEDS) * CFG["lr"] * rtol + 4 * FP32_UNIT_ROUNDOFF * w.abs().max().item()
        assert (w - got["weights"][n]).abs().max().item() <= bound, n

    resumed = Trainer(TrainerConfig(**cfg), hf, load=layout_ckpt)  # saved by the layout, resumed on one rank
    assert all(torch.equal(w, got["weights"][n]) for n, w in resumed.named_hf_weights())
    after_resume, uninterrupted = resumed.train_step(batch(7)), one.train_step(batch(7))
    for k in uninterrupted:
        assert close(after_resume[k], uninterrupted[k], rtol), k
