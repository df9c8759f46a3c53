"""Pipeline stages on GPUs (NCCL between stages): the schedule runs, and trainer rank 0 gathers the whole
model on its GPU, the tensors every push transport (the bucket broadcast, vLLM's NCCL weight transfer)
takes from there. Needs two GPUs (NCCL joins one rank per device)."""
import os

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per pipeline stage")]


def _stage(rank, port, hf, out):
    from trainer.config import TrainerConfig
    from trainer.distributed import init_distributed, teardown
    from trainer.trainer import Trainer
    from trainer_fixtures import make_batch
    from vime.parallel_layout import ParallelLayout

    layout = ParallelLayout(pp=2)
    init_distributed(rank, 2, "127.0.0.1", port, layout)  # NCCL: every stage on its own GPU
    trainer = Trainer(TrainerConfig(**layout.config_fields(), enable_mtp_training=True, micro_batch_size=2), hf)
    named = trainer.named_hf_weights()  # before any step: the checkpoint's weights
    metrics = trainer.train_step(make_batch(seed=0))
    if rank == 0:
        assert all(t.is_cuda for _, t in named)
        torch.save({"weights": {k: v.cpu() for k, v in named}, "metrics": metrics}, out)
    teardown()


def test_pipeline_stages_on_gpus_train_and_gather_the_whole_model_on_rank_0s_gpu(tmp_path):
    from trainer_fixtures import make_tiny
    from vime.models.hf_format import load_hf_checkpoint
    from vime.net import free_port

    hf, out = str(tmp_path / "hf"), str(tmp_path / "out.pt")
    make_tiny(hf, seed=4)
    mp.spawn(_stage, args=(free_port(), hf, out), nprocs=2, join=True)
    got = torch.load(out)
    _, state, _ = load_hf_checkpoint(hf)
    assert set(got["weights"]) == set(state) and os.path.isfile(out)
    assert all(torch.equal(got["weights"][k], state[k]) for k in state)
    assert got["metrics"]["train/mtp_loss"] > 0 and got["metrics"]["train/grad_norm"] > 0
