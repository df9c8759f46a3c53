"""GPU paths fixed by reading (skipped without CUDA): batches and collectives on the model's
device, NCCL weight sync with CUDA tensors, the Transformer-Engine spec's parameter names,
and an fp32 engine that never picks flash-attn."""
import os

import pytest
import torch
import torch.multiprocessing as mp

from vime.models.megatron_names import hf_targets
from rollout.embedded.kv_cache import pick_attention_backend
from vime.errors import UserError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_transformer_engine_norm_names_map_to_the_hf_norms():  # runs on CPU too
    assert hf_targets("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", 2) == (
        None, ("model.layers.1.input_layernorm.weight",))
    assert hf_targets("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", 2) == (
        None, ("model.layers.0.post_attention_layernorm.weight",))


def test_fp32_never_picks_flash_attention():  # runs on CPU too: the choice needs no GPU
    assert pick_attention_backend("cuda", "auto", torch.float32) == "sdpa"
    with pytest.raises(UserError, match="fp16 or bf16"):
        pick_attention_backend("cuda", "flash", torch.float32)


@cuda
def test_fp32_engine_on_gpu_uses_sdpa(small_ckpt):
    from rollout.embedded.engine import Engine, EngineConfig

    assert Engine.from_checkpoint(small_ckpt, EngineConfig(device="cuda")).backend == "sdpa"


def _one_train_step(hf):
    """The metrics of one joint policy + MTP step on the tiny checkpoint, on the trainer's device."""
    from trainer.config import TrainerConfig
    from trainer.distributed import teardown
    from trainer.trainer import Trainer
    from trainer_fixtures import make_batch

    trainer = Trainer(TrainerConfig(lr=1e-2, enable_mtp_training=True, micro_batch_size=2), hf)
    device = trainer.device.type
    metrics = trainer.train_step(make_batch(seed=1))  # the batch is built on the CPU
    teardown()
    return device, metrics


def _cpu_train_step(rank, hf, out):
    torch.save(_one_train_step(hf), out)


@cuda
def test_trainer_on_gpu_trains_on_cpu_built_batches_like_the_cpu_trainer(tmp_path):
    from fp32_bounds import close, reduction_rtol
    from trainer_fixtures import TINY, make_tiny

    hf = str(tmp_path / "hf")
    make_tiny(hf, seed=4)
    # the CPU reference runs in a process that sees no GPU: megatron-core puts its rotary tables on
    # the current CUDA device whenever one is visible, so a CPU model cannot run beside a GPU
    hidden = {"CUDA_VISIBLE_DEVICES": ""}
    saved = {k: os.environ.get(k) for k in hidden}
    os.environ.update(hidden)
    try:
        mp.spawn(_cpu_train_step, args=(hf, str(tmp_path / "cpu.pt")), nprocs=1, join=True)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    results = {"cpu": torch.load(tmp_path / "cpu.pt", weights_only=False), "cuda": _one_train_step(hf)}
    assert [results[d][0] for d in ("cpu", "cuda")] == ["cpu", "cuda"]
    rtol = reduction_rtol(TINY["intermediate_size"], 3 * 2 * 2 * TINY["num_hidden_layers"] + 4)
    cpu, gpu = results["cpu"][1], results["cuda"][1]
    for key in ("train/policy_loss", "train/mtp_loss", "train/grad_norm"):
        assert close(gpu[key], cpu[key], rtol, scale=max(abs(cpu[key]), 1.0)), key


def _nccl_sync(rank, port, out):
    from vime import weight_sync

    torch.cuda.set_device(rank)
    group = weight_sync.make_group("127.0.0.1", port, rank, 2, "nccl")
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(5, 3, generator=g)), ("b", torch.randn(7, generator=g))]
    layout = weight_sync.bucket_layout(named, 64)
    device = weight_sync.device_for("nccl")
    if rank == 0:  # the trainer's tensors live on its GPU: the buckets are built there
        weight_sync.send(group, layout, [(k, v.to(device)) for k, v in named])
    else:
        got = list(weight_sync.receive(group, layout, device))
        assert all(t.is_cuda for _, t in got)
        torch.save(weight_sync.checksum(got) == weight_sync.checksum(named), out)


@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_nccl_weight_sync_sends_cuda_tensors(tmp_path):
    from vime.net import free_port

    out = str(tmp_path / "ok.pt")
    mp.spawn(_nccl_sync, args=(free_port(), out), nprocs=2, join=True)
    assert torch.load(out) is True and os.path.isfile(out)


@cuda
@pytest.mark.skipif(not __import__("trainer.model", fromlist=["spec_name"]).spec_name() == "te",
                    reason="needs Transformer Engine")
def test_drafter_reuse_attention_is_refused_with_transformer_engine_layers(tmp_path):
    from trainer.config import TrainerConfig
    from trainer.trainer import Trainer
    from trainer_fixtures import make_tiny

    make_tiny(tmp_path / "hf", seed=4)
    with pytest.raises(UserError, match="--mtp-reuse-attention megatron"):
        Trainer(TrainerConfig(enable_mtp_training=True, mtp_train_depths=3), str(tmp_path / "hf"))


@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_ep2_on_two_gpus_trains_the_moe_model_like_one_gpu(tmp_path):
    """Expert parallelism on CUDA: megatron's all-to-all token dispatcher over NCCL, the expert gather of
    the push on the GPUs; log-probs, losses, grad norms, full weights and the checkpoint as on one GPU."""
    from test_trainer_tensor_parallel import assert_expert_layout_trains_like_one_rank_and_resumes_on_one

    assert_expert_layout_trains_like_one_rank_and_resumes_on_one(tmp_path, "glm4_moe", "ep2")
