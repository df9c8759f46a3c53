"""train_rl.py --enable-mtp-training on the shipped GLM-4.5 and DeepSeek-V3 models with each of megatron-core's
options the trainer runs (trainer/optimizer.py: the distributed optimizer, CPU offload at fractions 1 and 0.5,
the precision-aware optimizer; trainer/model.py: full and selective recompute, sequence parallelism at TP2 x EP2
and TP2 x PP2 x EP2), against one rank with the plain optimizer: the losses and grad norms of the first and
the fourth step, and the weights the four steps leave, within what the order of fp32 reductions can change.

Every run trains on the same rollouts (--debug-train-only on the rollouts one --debug-rollout-only run saved),
so the trainer is all that differs, also after the first update. The fp32 options compare with one fp32 rank;
the options megatron-core runs in bf16 only (CPU offload steps the fp32 copies of bf16 weights; the
precision-aware optimizer keeps fp32 masters of bf16 ones) compare with one bf16 rank of the plain optimizer,
at the same layout, so that both compute the same bf16 forwards and differ only in the optimizer's fp32
arithmetic. Each is a whole run (1-2 min on 2 cores): slow-marked.
"""
import os

import pytest
import torch

from tests.fp32_bounds import FP32_UNIT_ROUNDOFF, close, longest_reduction, probable_reduction_rtol
from tests.test_train_rl import REPO, metrics, run_train
from vime.models.hf_format import read_config

SHIPPED = {"glm4_moe": os.path.join(REPO, "checkpoints", "tiny-glm4-moe-mtp"),
           "deepseek_v3": os.path.join(REPO, "checkpoints", "tiny-deepseek-v3-mtp")}
STEPS = 4
LR = 1e-3  # --adam-eps = the lr: Adam does not amplify a rounding difference (test_trainer_tensor_parallel.py)
COMPARED = ("train/policy_loss", "train/mtp_loss", "train/entropy", "train/grad_norm", "train/mtp_grad_norm")
OFFLOAD = ("--use-distributed-optimizer", "--optimizer-cpu-offload")
SP_EP = ("--tensor-model-parallel-size", 2, "--sequence-parallel", "--expert-model-parallel-size", 2,
         "--expert-tensor-parallel-size", 1)
# option -> (the reference's precision, its flags)
OPTIONS = {
    "distributed-optimizer-dp2": ("fp32", ("--data-parallel-size", 2, "--use-distributed-optimizer")),
    "cpu-offload-1": ("bf16", OFFLOAD),
    "cpu-offload-0.5": ("bf16", (*OFFLOAD, "--optimizer-offload-fraction", 0.5, "--overlap-cpu-optimizer-d2h-h2d")),
    "precision-aware": ("bf16", (*OFFLOAD, "--use-precision-aware-optimizer")),
    "recompute-full": ("fp32", ("--recompute-granularity", "full", "--recompute-method", "uniform",
                                "--recompute-num-layers", 1)),
    "recompute-selective": ("fp32", ("--recompute-granularity", "selective")),
    "sp-tp2-ep2": ("fp32", SP_EP),
    "sp-tp2-pp2-ep2": ("fp32", (*SP_EP, "--pipeline-model-parallel-size", 2)),
}


def run_args(ckpt, out, *extra):
    """A run's flags: the rollouts' shape, and `extra`."""
    return ["--hf-checkpoint", ckpt, "--num-rollout", STEPS, "--rollout-batch-size", 4, "--n-samples-per-prompt", 4,
            "--global-batch-size", 16, "--micro-batch-size", 8, "--rollout-max-response-len", 12,
            "--custom-rm-path", "tests.rewards_for_tests:parity_reward", "--output-dir", out, "--progress", "false",
            "--use-wandb", "false", "--vllm-speculative-config", '{"method":"mtp","num_speculative_tokens":2}',
            "--mtp-num-layers", 1, *extra]


TRAINER = ("--lr", LR, "--adam-eps", LR, "--draft-lr", LR, "--enable-mtp-training")


def layout_flags(ckpt, flags):
    """`flags` with the first stage taking the smaller share of layers that do not split evenly over two stages."""
    layers = read_config(ckpt).num_hidden_layers
    if "--pipeline-model-parallel-size" in flags and layers % 2:
        flags = (*flags, "--decoder-first-pipeline-num-layers", layers // 2)
    return flags


def trained(ckpt, rollouts, out, *flags):
    """(metrics rows, {name: tensor} of the weights saved after the last step) of a --debug-train-only run."""
    save = os.path.join(out, "save")
    proc = run_train(*run_args(ckpt, out, *TRAINER, "--debug-train-only", "--load-debug-rollout-data", rollouts,
                               "--save", save, *flags), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics(out), saved_weights(save)


def saved_weights(save):
    """The model weights of the run's last torch_dist checkpoint, whole (megatron stores global tensors; its
    reader needs a process group: one of this process)."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    from trainer.distributed import owned_single_process
    from vime.checkpointing import resolve_load

    _, iteration, _ = resolve_load(save)
    with owned_single_process():
        tensors = load_plain_tensors(os.path.join(iteration, "model"))
    return {k: v for k, v in tensors.items() if torch.is_tensor(v) and not k.startswith("optimizer.")}  # no extra state


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per shipped model: the rollouts every run trains on, and one rank's plain run per precision (made once)."""
    made = {}

    def run(family, precision=None):
        key = (family, precision)
        if key not in made:
            ckpt, out = SHIPPED[family], tmp_path_factory.mktemp(f"{family}_{precision}")
            if precision is None:
                data = os.path.join(out, "rollouts")
                proc = run_train(*run_args(ckpt, out, "--debug-rollout-only", "--save-debug-rollout-data", data),
                                 timeout=900)
                assert proc.returncode == 0, proc.stderr[-3000:]
                made[key] = data
            else:
                made[key] = trained(ckpt, run(family), out, *(("--bf16",) if precision == "bf16" else ()))
        return made[key]
    return run


def rtol_of(ckpt):
    """fp32 reduction order through a forward, backward and norm of every layer and the MTP layer, and through a
    pipeline's per-stage sums of the grad norm: what a layout or an optimizer's arithmetic may change."""
    cfg = read_config(ckpt)
    depth = 3 * 2 * 2 * (cfg.num_hidden_layers + cfg.num_nextn_predict_layers) + 5
    return probable_reduction_rtol(longest_reduction(cfg, cfg.max_position_embeddings), depth)


@pytest.mark.slow
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("family", sorted(SHIPPED))
def test_each_option_trains_the_shipped_moe_model_as_one_rank_with_the_plain_optimizer(runs, tmp_path, family, option):
    precision, flags = OPTIONS[option]
    ckpt = SHIPPED[family]
    one, one_weights = runs(family, precision)
    bf16 = ("--bf16",) if precision == "bf16" else ()
    got, weights = trained(ckpt, runs(family), tmp_path, *bf16, *layout_flags(ckpt, flags))
    rtol = rtol_of(ckpt)
    assert rtol <= 1e-4 and len(got) == len(one) == STEPS
    for step in (0, STEPS - 1):
        for key in COMPARED:
            assert close(got[step][key], one[step][key], rtol), (step, key, got[step][key], one[step][key])
    assert one[0]["train/grad_norm"] > 0 and one[0]["train/mtp_loss"] > 0
    # each step moves a weight by at most the lr times the relative change of its Adam direction (<= rtol), and a
    # bf16 weight rounds its master: the masters may then part by a rounding of their own each step
    assert weights.keys() == one_weights.keys()
    for name, w in one_weights.items():
        ulp = (2.0 ** -8 if w.dtype == torch.bfloat16 else FP32_UNIT_ROUNDOFF) * w.float().abs().max().item()
        atol = STEPS * (LR * rtol + ulp)
        assert (weights[name].float() - w.float()).abs().max().item() <= atol, name
