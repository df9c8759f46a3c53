"""megatron-core's optimizer options on a GPU (skipped without CUDA), where the CPU runs a stand-in or refuses:

- CPU Adam (megatron's HybridDeviceOptimizer with its CUDA streams and pinned host copies) at fractions 1 and
  0.5 updates the weights as the plain bf16 optimizer does, and the optimizer state it keeps on the GPU shrinks
  by the share it moved to the host;
- the precision-aware optimizer (Transformer Engine's FusedAdam; skipped without it) with fp32 moments and
  gradients takes the plain bf16 optimizer's first step, and with bf16 moments and gradients keeps fewer bytes;
- --offload-train: the trainer's weights, gradient buffers and optimizer state leave the GPU while the engines
  would generate (torch.cuda.memory_allocated drops by at least their bytes) and its updates are unchanged.

Run on a GPU machine: `python -m pytest -q tests/gpu/test_gpu_optimizer.py`."""
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def trainer(hf, **settings):
    from trainer.config import TrainerConfig
    from trainer.trainer import Trainer

    return Trainer(TrainerConfig(lr=1e-3, adam_eps=1e-3, micro_batch_size=4, bf16=True, **settings), hf)


def steps(t, seeds=(1, 2)):
    from tests.trainer_fixtures import random_scored_samples
    from trainer.batch import build_batch

    return [t.train_step(build_batch(random_scored_samples(n=8, seed=s))) for s in seeds]


def weights(t):
    return {k: v.detach().float().cpu() for k, v in t.model.state_dict().items() if torch.is_tensor(v)}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from tests.trainer_fixtures import make_tiny

    path = tmp_path_factory.mktemp("gpu_optimizer")
    make_tiny(path, seed=6, family="glm4_moe")
    return str(path)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_cpu_adam_updates_as_the_plain_optimizer_and_frees_its_share_of_the_gpu(hf, fraction):
    from trainer.optimizer import held_bytes

    plain = trainer(hf)
    plain_metrics = steps(plain)
    offloaded = trainer(hf, use_distributed_optimizer=True, optimizer_cpu_offload=True,
                        optimizer_offload_fraction=fraction, overlap_cpu_optimizer_d2h_h2d=True)
    metrics = steps(offloaded)
    assert metrics[0]["train/grad_norm"] == pytest.approx(plain_metrics[0]["train/grad_norm"], rel=1e-5)
    want = weights(plain)
    for name, w in weights(offloaded).items():  # the masters part by fp32 roundings; a bf16 weight by one ulp
        assert (w - want[name]).abs().max().item() <= 2 * 2.0 ** -8 * want[name].abs().max().item() + 1e-6, name
    held, kept = held_bytes(offloaded.model, offloaded.parts), held_bytes(plain.model, plain.parts)
    assert held["optimizer_host"] > 0
    assert held["optimizer"] <= (1 - fraction) * kept["optimizer"] + 12 * max(p.numel() for p in plain.policy_params())


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine")
def test_the_precision_aware_optimizer_takes_the_plain_step_and_holds_less_with_bf16_moments(hf):
    from trainer.optimizer import held_bytes

    plain = trainer(hf, use_distributed_optimizer=True)
    aware = trainer(hf, use_distributed_optimizer=True, use_precision_aware_optimizer=True)
    assert steps(aware, (1,))[0]["train/grad_norm"] == pytest.approx(steps(plain, (1,))[0]["train/grad_norm"],
                                                                     rel=1e-5)
    small = trainer(hf, use_distributed_optimizer=True, use_precision_aware_optimizer=True, main_grads_dtype="bf16",
                    exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    steps(small, (1,))
    assert held_bytes(small.model, small.parts)["gradients"] * 2 == held_bytes(plain.model, plain.parts)["gradients"]


def test_offload_train_leaves_the_gpu_while_the_engines_generate_and_updates_as_before(hf):
    from trainer.optimizer import held_bytes

    kept, moved = trainer(hf, use_distributed_optimizer=True), trainer(hf, use_distributed_optimizer=True)
    steps(kept)
    for seed in (1, 2):
        moved.onload()
        steps(moved, (seed,))
        torch.cuda.synchronize()
        before, held = torch.cuda.memory_allocated(), held_bytes(moved.model, moved.parts)
        moved.offload(weights=True)
        assert before - torch.cuda.memory_allocated() >= held["weights"] + held["gradients"] + held["optimizer"]
    moved.onload()
    want = weights(kept)
    assert all(torch.equal(w, want[name]) for name, w in weights(moved).items())
