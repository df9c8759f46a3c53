"""Routing replay with the vLLM-CPU rollout: routes recorded in vLLM's worker, replayed by the trainer.

References as in test_routing_replay.py: a direct recomputation of the routes on each sample's final
sequence (the module model's hidden states through moe_routing.route; near ties exempt and counted),
and megatron's routers' own output for the routes the trainer applies. The rollout is sampled with
MTP speculation (k = 2), so verify forwards write routes for drafts that get rejected.
"""
import pytest

pytest.importorskip("vllm")

from bad_input_helpers import refused  # noqa: E402
from moe_fixtures import VLLM_CPU_MLA, write_checkpoint  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from test_bad_inputs import args_for  # noqa: E402
from test_routing_replay import (MTP_K2, PROMPTS, assert_routes_match_except_near_ties,  # noqa: E402
                                 assert_trainer_applies_the_batch_routes, near_tie_bound, reference_routes)
from trainer.batch import build_batch  # noqa: E402
from vime.models.hf_format import read_config  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402

CASES = {"glm4_moe": ("glm4_moe", dict(seed=41)), "deepseek_v3": ("deepseek_v3", dict(VLLM_CPU_MLA, seed=42))}


# the default run records routes on GLM-4.5; DeepSeek-V3's (MLA on vLLM-CPU) under -m slow
@pytest.fixture(scope="module", params=["glm4_moe", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def vllm_rollout(request, tmp_path_factory):
    """(checkpoint, samples vLLM-CPU generated with MTP speculation, sampled at T = 1)."""
    from rollout.vllm.backend import VLLMBackend

    family, options = CASES[request.param]
    path = str(tmp_path_factory.mktemp(f"vllm_r3_{family}"))
    write_checkpoint(path, family, **options)
    backend = VLLMBackend(path, MTP_K2, max_batch_size=8)
    try:
        samples = samples_for_prompts(PROMPTS, n=2)
        backend.generate(samples, SamplingParams(temperature=1.0, max_new_tokens=12, seed=5))
        spec = backend.stats()["spec"]
        assert spec["draft_tokens"] > spec["accepted_tokens"]  # some drafts were rejected
    finally:
        backend.close()
    for i, s in enumerate(samples):
        s.advantage = float(i % 3) - 1.0
    return path, samples


def test_vllm_cpu_routes_equal_a_recomputation_on_the_final_sequence(vllm_rollout):
    path, samples = vllm_rollout
    cfg = read_config(path)
    pairs = []
    for s in samples:
        assert s.routed_experts.shape[0] == len(s.tokens) - 1
        want, margins, largest = reference_routes(path, s)
        pairs.append((s.routed_experts, want, margins, near_tie_bound(cfg, len(s.tokens), largest)))
    assert_routes_match_except_near_ties(pairs)


def test_with_replay_the_trainer_applies_vllms_routes(vllm_rollout):
    path, samples = vllm_rollout
    metrics = assert_trainer_applies_the_batch_routes(path, build_batch(samples))
    assert metrics["train/route_disagreement"] < 0.05  # fp32 vLLM and trainer: only near ties differ


def test_routing_replay_on_a_vllm_build_without_the_router_capture_hook_is_refused(vllm_rollout, tmp_path,
                                                                                    monkeypatch):
    from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter

    monkeypatch.delattr(FusedMoERouter, "set_capture_fn")
    path, _ = vllm_rollout
    refused(args_for(path, tmp_path, "--rollout-backend", "vllm", "--use-rollout-routing-replay"),
            "--use-rollout-routing-replay", "cannot return routed experts", "--rollout-backend embedded")
