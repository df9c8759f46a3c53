"""Parallel layouts of the trainer over gloo processes compute what one rank computes: TP=2 gives the
TP=1 losses and a TP=2 checkpoint loads at TP=1; on the MoE models expert parallelism (EP, ETP) gives
one rank's losses, grad norms and full per-expert weights, replays routes as one rank does, and its
checkpoints resume on one rank and back (the distributed optimizer's at DP=2 on one rank, and one rank's and
its own in it at DP=2); pipeline stages (PP=2, uneven stages, TP=2 x PP=2, PP=2 x EP=2
x DP=2, an external draft reading layers of both stages) give one rank's log-probs, losses, grad norms
and pushed weights, and their checkpoints move between one rank and the layout in both directions."""
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
from vime.parallel_layout import ParallelLayout
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


# MoE trains at TP 1 (test_trainer_moe.py); the default run splits one dense family, -m slow every one
@pytest.mark.parametrize("family", [f if f == "mimo" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in sorted(MTP_FAMILIES)])
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


def one_rank_resumed(tmp_path, hf):
    """(a one-rank trainer's checkpoint after one step, the step after it, the weights that step leaves)."""
    one = Trainer(TrainerConfig(**CFG), hf)
    one.train_step(make_batch(seed=SEEDS[0]))
    one.save(str(tmp_path / "one"))
    return str(tmp_path / "one"), one.train_step(make_batch(seed=7)), dict(one.named_hf_weights())


def assert_resumed_step_is_the_uninterrupted_one(hf, metrics, weights, uninterrupted, want):
    """The step after a resume moves the weights as the uninterrupted run's does: Adam's update reads the moments
    and the step count it resumed; two steps, each moving a weight by at most lr times its update's change."""
    rtol = moe_rtol(hf)
    assert close(metrics["train/grad_norm"], uninterrupted["train/grad_norm"], rtol)
    assert weights.keys() == want.keys()
    for n, w in want.items():
        atol = 2 * CFG["lr"] * rtol + 4 * FP32_UNIT_ROUNDOFF * w.abs().max().item()
        assert (weights[n] - w).abs().max().item() <= atol, n


DISTRIBUTED = {"use_distributed_optimizer": True}  # at DP2: Adam's state sharded over the two ranks


@pytest.mark.slow  # a DP2 run beside one-rank trainers (about 1 min on 2 cores)
def test_a_distributed_optimizers_checkpoint_resumes_on_one_rank_with_the_plain_optimizer(tmp_path):
    """--use-distributed-optimizer at DP2 saves Adam's state gathered by parameter (megatron's fully_reshardable
    format), so one rank's plain optimizer resumes it."""
    hf = MOE_CHECKPOINTS["glm4_moe"]
    _, uninterrupted, want = one_rank_resumed(tmp_path, hf)
    spawn_layout(tmp_path, hf, DISTRIBUTED, 2, SEEDS[:1], ckpt=str(tmp_path / "distributed"))
    resumed = Trainer(TrainerConfig(**CFG), hf, load=str(tmp_path / "distributed"))
    metrics = resumed.train_step(make_batch(seed=7))
    assert_resumed_step_is_the_uninterrupted_one(hf, metrics, dict(resumed.named_hf_weights()), uninterrupted, want)


@pytest.mark.slow
def test_a_one_rank_checkpoint_resumes_in_a_distributed_optimizer_at_dp2(tmp_path):
    """The plain optimizer's checkpoint at one rank resumes in the distributed optimizer at DP2, each rank taking
    its shard of Adam's moments and the step count."""
    hf = MOE_CHECKPOINTS["glm4_moe"]
    ckpt, uninterrupted, want = one_rank_resumed(tmp_path, hf)
    run = spawn_layout(tmp_path, hf, DISTRIBUTED, 2, (7,), load=ckpt)
    assert_resumed_step_is_the_uninterrupted_one(hf, run["metrics"][0], run["weights"], uninterrupted, want)


@pytest.mark.slow
def test_a_distributed_optimizers_checkpoint_resumes_in_a_distributed_optimizer(tmp_path):
    """What a healed --use-distributed-optimizer run does: DP2 saves, DP2 resumes, the step after as one rank's."""
    hf = MOE_CHECKPOINTS["glm4_moe"]
    _, uninterrupted, want = one_rank_resumed(tmp_path, hf)
    spawn_layout(tmp_path, hf, DISTRIBUTED, 2, SEEDS[:1], ckpt=str(tmp_path / "distributed"))
    run = spawn_layout(tmp_path, hf, DISTRIBUTED, 2, (7,), load=str(tmp_path / "distributed"))
    assert_resumed_step_is_the_uninterrupted_one(hf, run["metrics"][0], run["weights"], uninterrupted, want)


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


# ---- pipeline stages ------------------------------------------------------------------------
CHECKPOINTS = os.path.join(REPO, "checkpoints")


def weight_tensor_count(hf):
    from vime.models.hf_format import load_hf_checkpoint

    return len(load_hf_checkpoint(hf)[1])


def pipeline_rtol(hf, layout, steps):
    """Stages run the ops one rank runs on the same tensors, so their forward and backward reorder no
    fp32 sum; what they split is the grad norm's sum over weight tensors (one reduction per step, reaching
    the next steps through the clip coefficient), the first and last stage's word-embedding grads (two
    terms, summed on the wire instead of in autograd: exact) and, with TP, TP's own reductions (RTOL), with
    experts split or data-parallel replicas, their reductions (moe_rtol)."""
    rtol = reduction_rtol(weight_tensor_count(hf), steps + 1)
    if layout.ep > 1 or layout.dp > 1:
        rtol += moe_rtol(hf)
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


def rollout_samples(hf, replay):
    """A step's samples by seed (trainer_tp_worker's `samples`): with random rollout routes of every MoE
    layer of `hf` when the run `replay`s them, else None (the worker's plain ones, make_batch's)."""
    if not replay:
        return None
    cfg = read_config(hf)
    moe_layers = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return functools.partial(routed_samples, moe_layers=moe_layers, k=cfg.moe.num_experts_per_tok,
                             num_experts=cfg.moe.n_routed_experts)


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
    # pipeline stages and expert parallelism together: 4 ranks, 2 stages x 2 data-parallel replicas whose
    # experts are split over both (each replica trains on its half of the batch)
    pytest.param("tiny-glm4-moe-mtp", ParallelLayout(pp=2, dp=2, ep=2, last_stage_layers=2), 1,
                 {"use_rollout_routing_replay": True}, id="pp2-ep2-dp2-glm4-moe-replay", marks=SLOW),
    pytest.param("tiny-deepseek-v3-mtp", ParallelLayout(pp=2, dp=2, ep=2, first_stage_layers=2), 0, {},
                 id="pp2-ep2-dp2-deepseek-v3", marks=SLOW),
])
def test_pipeline_stages_train_like_one_rank_and_checkpoints_move_between_layouts(tmp_path, model, layout, warm,
                                                                                  options):
    hf = layout_checkpoint(model, tmp_path)
    one_ckpt, layout_ckpt = str(tmp_path / "one"), str(tmp_path / "layout")
    cfg = dict(CFG, **options)
    samples = rollout_samples(hf, cfg.get("use_rollout_routing_replay"))

    def batch(seed):
        return make_batch(seed=seed) if samples is None else build_batch(samples(seed))

    one = Trainer(TrainerConfig(**cfg), hf)
    for s in range(warm):  # the layout resumes a one-rank run after `warm` steps (0: at its step 0)
        one.train_step(batch(10 + s))
    one.save(one_ckpt)
    got = spawn_layout(tmp_path, hf, layout.config_fields(), layout.world_size, SEEDS, ckpt=layout_ckpt,
                       load=one_ckpt, samples=samples, cfg=cfg)
    rtol = pipeline_rtol(hf, layout, warm + len(SEEDS) + 1)

    lp = one.compute_logprobs(batch(SEEDS[0]))[0::layout.dp]  # rank 0's data-parallel rows
    assert (lp[:, :got["logprobs"].shape[1]] - got["logprobs"]).abs().max().item() <= rtol * lp.abs().max().item()
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
