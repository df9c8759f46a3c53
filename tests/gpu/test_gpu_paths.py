"""GPU-only paths (skipped without CUDA): flash-attn decoding and the NCCL weight-sync group.

These are not part of the CPU coverage; run them on a CUDA machine with `python -m pytest tests/gpu`."""
import pytest
import torch

from rollout.embedded.engine import Engine, EngineConfig
from vime.sample import samples_for_prompts
from rollout.sampling_params import SamplingParams

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def has_flash_attn():
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@cuda
@pytest.mark.skipif(not has_flash_attn(), reason="needs flash_attn")
def test_flash_attention_greedy_output_equals_sdpa_on_gpu(small_ckpt, task_prompt_ids):
    params = SamplingParams(temperature=0, max_new_tokens=24)
    outs = {}
    for backend in ("sdpa", "flash"):
        engine = Engine.from_checkpoint(small_ckpt, EngineConfig(device="cuda", dtype=torch.bfloat16,
                                                                 attention_backend=backend))
        outs[backend] = [s.response_ids for s in engine.generate(samples_for_prompts(task_prompt_ids), params)]
    agree = sum(a == b for a, b in zip(outs["sdpa"], outs["flash"])) / len(task_prompt_ids)
    assert agree >= 0.9  # bf16 kernels may flip near-ties


@cuda
def test_engine_on_gpu_matches_cpu_greedy_in_fp32(small_ckpt, task_prompt_ids):
    params = SamplingParams(temperature=0, max_new_tokens=24)
    cpu = Engine.from_checkpoint(small_ckpt).generate(samples_for_prompts(task_prompt_ids), params)
    gpu = Engine.from_checkpoint(small_ckpt, EngineConfig(device="cuda", attention_backend="sdpa")).generate(
        samples_for_prompts(task_prompt_ids), params)
    assert [s.response_ids for s in cpu] == [s.response_ids for s in gpu]


@cuda
def test_mtp_speculation_on_gpu_greedy_equals_plain_greedy(small_ckpt, task_prompt_ids):
    from rollout.embedded.engine_builder import build_engine

    params = SamplingParams(temperature=0, max_new_tokens=24)
    config = EngineConfig(device="cuda", attention_backend="sdpa")
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    outs = {}
    for name, arm in (("plain", None), ("spec", spec)):
        engine = build_engine(small_ckpt, arm, config)
        outs[name] = [s.response_ids for s in engine.generate(samples_for_prompts(task_prompt_ids), params)]
    assert outs["spec"] == outs["plain"]

