"""train_rl.py end to end on the MoE models with the routed experts split over trainer ranks: the first
RL step of an expert-parallel trainer (EP2 over two data-parallel ranks, and PP2 x EP2 x DP2: four ranks,
two pipeline stages whose experts are split over the two data-parallel replicas of each, the MTP layer
on the last stage) equals one rank's, on the embedded engine and on vLLM.

Every run rolls out the same samples (the same engine, weights and seed), so the trainer layout is all
that differs: the step's policy loss, MTP loss, entropy and grad norms, and the checksums of the
weights pushed after it (the full per-expert HF tensors every engine receives, gathered over the
stages and the expert ranks, each compared tensor by tensor with the trainer's under
--check-weight-update-equal), equal one rank's within what fp32 reduction order can change
(tests/fp32_bounds.py probable_reduction_rtol, <= 1e-4). The GLM-4.5 runs replay the rollout's routes
(--use-rollout-routing-replay) and log train/route_disagreement. The one-rank run of a model and
engine is made once per module and compared with every layout. A whole run each: slow-marked
(1-4 min per run on 2 cores).
"""
import os

import pytest

from rollout.task import make_prompts, write_jsonl
from tests.fp32_bounds import close, longest_reduction, probable_reduction_rtol
from tests.moe_fixtures import VLLM_CPU_MLA, write_checkpoint
from tests.test_train_rl import REPO, metrics, run_train
from tests.test_train_rl_pipeline import weight_tensor_count
from vime.models.draft_kinds import is_draft_name
from vime.models.hf_format import load_hf_checkpoint, read_config

SHIPPED = {"glm4_moe": os.path.join(REPO, "checkpoints", "tiny-glm4-moe-mtp"),
           "deepseek_v3": os.path.join(REPO, "checkpoints", "tiny-deepseek-v3-mtp")}
# the layouts compared with one rank, by test id: their trainer flags
EP2 = ("--data-parallel-size", 2, "--expert-model-parallel-size", 2)
PP = "--pipeline-model-parallel-size"
LAYOUTS = {"ep2": EP2, "pp2-ep2-dp2": (PP, 2, *EP2)}
LR, DRAFT_LR = 1e-3, 5e-3  # --adam-eps = the lr: Adam does not amplify a rounding difference (test_trainer_tensor_parallel.py)
KEYS = ("train/policy_loss", "train/mtp_loss", "train/entropy", "train/grad_norm", "train/mtp_grad_norm")
REPLAY = {"glm4_moe": ("--use-rollout-routing-replay",), "deepseek_v3": ()}


def run_args(ckpt, out, backend, *extra):
    return ["--hf-checkpoint", ckpt, "--rollout-backend", backend, "--num-rollout", 1, "--rollout-batch-size", 4,
            "--n-samples-per-prompt", 4, "--global-batch-size", 16, "--micro-batch-size", 8,
            "--rollout-max-response-len", 12, "--lr", LR, "--adam-eps", LR, "--draft-lr", DRAFT_LR,
            "--custom-rm-path", "tests.rewards_for_tests:parity_reward", "--output-dir", out, "--progress", "false",
            "--vllm-speculative-config", '{"method":"mtp","num_speculative_tokens":2}', "--enable-mtp-training",
            "--mtp-num-layers", 1, "--check-weight-update-equal", "--use-wandb", "false", *extra]


def layout_flags(ckpt, name):
    """The trainer flags of layout `name` for `ckpt`: decoder layers that do not split evenly over two
    stages leave the first stage the smaller share (the shipped models' 5 layers: 2 + 3)."""
    flags = LAYOUTS[name]
    layers = read_config(ckpt).num_hidden_layers
    if PP in flags and layers % 2:
        flags += ("--decoder-first-pipeline-num-layers", layers // 2)
    return flags


def rtol_of(ckpt, pipelined=False):
    """fp32 reduction order through a forward, backward and norm of every layer and the MTP layer; stages
    add one link to that chain (the grad norm's sum over weight tensors, split into one sum per stage)."""
    cfg = read_config(ckpt)
    depth = 3 * 2 * 2 * (cfg.num_hidden_layers + cfg.num_nextn_predict_layers) + 4
    longest = longest_reduction(cfg, cfg.max_position_embeddings)
    if pipelined:
        depth, longest = depth + 1, max(longest, weight_tensor_count(ckpt))
    return probable_reduction_rtol(longest, depth)


def checksum_atol(ckpt, draft, rtol):
    """How far the sum of the pushed values may move: Adam's first step (eps = lr) moves each weight by at
    most lr * r / 4 for a relative gradient difference r, so the sum of N weights by N * lr * r / 4."""
    cfg, state, _ = load_hf_checkpoint(ckpt)
    n = sum(t.numel() for name, t in state.items() if is_draft_name(name, cfg.num_hidden_layers) == draft)
    return n * (DRAFT_LR if draft else LR) * rtol / 4


def first_step(ckpt, out, backend, *flags):
    """The metrics of the first RL step of a train_rl.py run with `flags` (every push checked tensor by tensor)."""
    proc = run_train(*run_args(ckpt, out, backend, *flags), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics(out)[0]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """first_step of one trainer rank, run once per (checkpoint, backend, flags) for every layout compared with it."""
    rows = {}

    def row(ckpt, backend, *extra):
        key = (ckpt, backend, extra)
        if key not in rows:
            rows[key] = first_step(ckpt, tmp_path_factory.mktemp("one_rank"), backend, *extra)
        return rows[key]
    return row


def assert_layout_steps_like_one_rank(one_rank, ckpt, tmp_path, backend, layout, *extra):
    one = one_rank(ckpt, backend, *extra)
    flags = layout_flags(ckpt, layout)
    got = first_step(ckpt, tmp_path / layout, backend, *flags, *extra)
    rtol = rtol_of(ckpt, pipelined=PP in flags)
    assert rtol <= 1e-4
    replayed = "--use-rollout-routing-replay" in extra
    for key in KEYS + (("train/route_disagreement",) if replayed else ()):
        assert close(got[key], one[key], rtol), (key, got[key], one[key])
    for key, draft in (("weight_sync/target_checksum", False), ("weight_sync/draft_checksum", True)):
        assert abs(got[key] - one[key]) <= checksum_atol(ckpt, draft, rtol), (key, got[key], one[key])
    assert one["train/grad_norm"] > 0 and one["train/mtp_loss"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", sorted(SHIPPED))
def test_expert_layouts_train_the_shipped_moe_model_like_one_rank_on_the_embedded_engine(tmp_path, one_rank, family,
                                                                                        layout):
    assert_layout_steps_like_one_rank(one_rank, SHIPPED[family], tmp_path, "embedded", layout, *REPLAY[family])


@pytest.fixture(scope="module")
def vllm_cpu_deepseek(tmp_path_factory):
    """DeepSeek-V3 at the MLA latent vLLM's CPU kernel is built for (the shipped one's is smaller)."""
    path = str(tmp_path_factory.mktemp("ep_deepseek_vllm"))
    write_checkpoint(path, "deepseek_v3", seed=41, **VLLM_CPU_MLA)
    write_jsonl(make_prompts(64, seed=1), os.path.join(path, "train.jsonl"))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_layouts_train_glm_moe_like_one_rank_with_vllm_rollouts(tmp_path, one_rank, layout):
    pytest.importorskip("vllm")
    assert_layout_steps_like_one_rank(one_rank, SHIPPED["glm4_moe"], tmp_path, "vllm", layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_layouts_train_deepseek_v3_like_one_rank_with_vllm_rollouts(tmp_path, one_rank, vllm_cpu_deepseek,
                                                                           layout):
    pytest.importorskip("vllm")
    assert_layout_steps_like_one_rank(one_rank, vllm_cpu_deepseek, tmp_path, "vllm", layout)
