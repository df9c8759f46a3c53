"""Sampled speculative decoding on vLLM keeps the policy's distribution.

vLLM (CPU build) with MTP k = 2 samples two tokens after one task prompt, N times with
distinct seeds; the joint of (token 1, token 2) must fit the exact one, computed by
transformers' Qwen2ForCausalLM on the same trunk, by a chi-square test at false-alarm rate
1e-3. Token 2 is always decided by the rejection sampler (verified against the drafts made
after token 1). The shipped pretrained model is used because its distributions are peaked: a
sampler that distorts them is visible, where a random model's near-uniform ones would hide it.
Negative control: the same counts against the policy at temperature 1.3 are rejected.
"""
import pytest

pytest.importorskip("vllm")

from vime.config import DEFAULT_TINY_MODEL  # noqa: E402
from vllm_spec_fixtures import first_two_p_value, sample_first_tokens  # noqa: E402

N, ALPHA = 4000, 1e-3


@pytest.fixture(scope="module")
def vllm_samples():
    from rollout.vllm.backend import VLLMBackend

    backend = VLLMBackend(DEFAULT_TINY_MODEL, {"method": "mtp", "num_speculative_tokens": 2}, max_batch_size=256)
    try:
        return sample_first_tokens(backend, DEFAULT_TINY_MODEL, N)
    finally:
        backend.close()


def test_vllm_sampled_speculative_tokens_follow_the_policy(vllm_samples):
    assert vllm_samples[2] > 0  # speculation really ran
    assert first_two_p_value(DEFAULT_TINY_MODEL, vllm_samples, 1.0) > ALPHA


def test_the_distribution_test_rejects_a_distorted_policy(vllm_samples):
    assert first_two_p_value(DEFAULT_TINY_MODEL, vllm_samples, 1.3) < ALPHA
