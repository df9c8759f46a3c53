"""train_rl.py end to end on the MoE models with the routed experts split over trainer ranks: the first
RL step of an expert-parallel trainer equals one rank's, on the embedded engine and on vLLM.

Both runs roll out the same samples (the same engine, weights and seed), so the trainer layout is all
that differs: the step's policy loss, MTP loss, entropy and grad norms, and the checksums of the
weights pushed after it (the full per-expert HF tensors every engine receives, each compared tensor
by tensor with the trainer's under --check-weight-update-equal), equal one rank's within what fp32
reduction order can change (tests/fp32_bounds.py probable_reduction_rtol, <= 1e-4). The GLM-4.5 runs
replay the rollout's routes (--use-rollout-routing-replay) and log train/route_disagreement.
A whole run each: slow-marked (1-3 min per pair on 2 cores).
"""
import os

import pytest

from rollout.task import make_prompts, write_jsonl
from tests.fp32_bounds import close, longest_reduction, probable_reduction_rtol
from tests.moe_fixtures import VLLM_CPU_MLA, write_checkpoint
from tests.test_train_rl import REPO, metrics, run_train
from vime.models.draft_kinds import is_draft_name
from vime.models.hf_format import load_hf_checkpoint, read_config

SHIPPED = {"glm4_moe": os.path.join(REPO, "checkpoints", "tiny-glm4-moe-mtp"),
           "deepseek_v3": os.path.join(REPO, "checkpoints", "tiny-deepseek-v3-mtp")}
# the layouts compared with one rank: (trainer flags, what the run adds)
EP2 = ("--data-parallel-size", 2, "--expert-model-parallel-size", 2)
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


def rtol_of(ckpt):
    """fp32 reduction order through a forward, backward and norm of every layer and the MTP layer."""
    cfg = read_config(ckpt)
    depth = 3 * 2 * 2 * (cfg.num_hidden_layers + cfg.num_nextn_predict_layers) + 4
    return probable_reduction_rtol(longest_reduction(cfg, cfg.max_position_embeddings), depth)


def checksum_atol(ckpt, draft, rtol):
    """How far the sum of the pushed values may move: Adam's first step (eps = lr) moves each weight by at
    most lr * r / 4 for a relative gradient difference r, so the sum of N weights by N * lr * r / 4."""
    cfg, state, _ = load_hf_checkpoint(ckpt)
    n = sum(t.numel() for name, t in state.items() if is_draft_name(name, cfg.num_hidden_layers) == draft)
    return n * (DRAFT_LR if draft else LR) * rtol / 4


def assert_ep2_steps_like_one_rank(ckpt, tmp_path, backend, *extra):
    rows = {}
    for name, layout in (("one", ()), ("ep2", EP2)):
        out = tmp_path / name
        proc = run_train(*run_args(ckpt, out, backend, *layout, *extra), timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows[name] = metrics(out)[0]
    one, ep2 = rows["one"], rows["ep2"]
    rtol = rtol_of(ckpt)
    assert rtol <= 1e-4
    replayed = "--use-rollout-routing-replay" in extra
    for key in KEYS + (("train/route_disagreement",) if replayed else ()):
        assert close(ep2[key], one[key], rtol), (key, ep2[key], one[key])
    for key, draft in (("weight_sync/target_checksum", False), ("weight_sync/draft_checksum", True)):
        assert abs(ep2[key] - one[key]) <= checksum_atol(ckpt, draft, rtol), (key, ep2[key], one[key])
    assert one["train/grad_norm"] > 0 and one["train/mtp_loss"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SHIPPED))
def test_ep2_trains_the_shipped_moe_model_like_one_rank_on_the_embedded_engine(tmp_path, family):
    assert_ep2_steps_like_one_rank(SHIPPED[family], tmp_path, "embedded", *REPLAY[family])


@pytest.fixture(scope="module")
def vllm_cpu_deepseek(tmp_path_factory):
    """DeepSeek-V3 at the MLA latent vLLM's CPU kernel is built for (the shipped one's is smaller)."""
    path = str(tmp_path_factory.mktemp("ep_deepseek_vllm"))
    write_checkpoint(path, "deepseek_v3", seed=41, **VLLM_CPU_MLA)
    write_jsonl(make_prompts(64, seed=1), os.path.join(path, "train.jsonl"))
    return path


@pytest.mark.slow
def test_ep2_trains_glm_moe_like_one_rank_with_vllm_rollouts(tmp_path):
    pytest.importorskip("vllm")
    assert_ep2_steps_like_one_rank(SHIPPED["glm4_moe"], tmp_path, "vllm")


@pytest.mark.slow
def test_ep2_trains_deepseek_v3_like_one_rank_with_vllm_rollouts(tmp_path, vllm_cpu_deepseek):
    pytest.importorskip("vllm")
    assert_ep2_steps_like_one_rank(vllm_cpu_deepseek, tmp_path, "vllm")
