"""The shipped EAGLE-3 draft as plain vLLM serves it (no vime code between): `vllm.LLM` with
`{"method": "eagle3", "model": DRAFT}` on the shipped Qwen2 target.

References: transformers' Qwen2ForCausalLM (greedy tokens), and the draft recomputed from scratch
at every verify step (accepted drafts per position, counted as vLLM counts them: before the
output is cut at EOS or the length), which the embedded engine also matches (tests/test_eagle3.py).
Sampled: through the vLLM rollout backend, the joint of the first two tokens fits the exact one
(transformers) by a chi-square test, and the negative control (the policy at temperature 1.3) fails.
Two vLLM starts (20-60 s each on 2 busy cores): the slow run.
"""
import pytest
import torch

pytest.importorskip("vllm")

from eagle3_fixtures import DRAFT, TARGET, reference_acceptance  # noqa: E402
from rollout.embedded.engine import EngineConfig  # noqa: E402
from rollout.embedded.engine_builder import build_engine  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from rollout.tokenizer import TextCodec  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402
from vllm_spec_fixtures import hf_greedy, serve, task_prompts, vllm_greedy  # noqa: E402

pytestmark = pytest.mark.slow
K, MAX_NEW = 3, 32


@pytest.fixture(scope="module")
def prompts():
    return task_prompts(TARGET)


@pytest.fixture(scope="module")
def llm():
    engine = serve(TARGET, {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K})
    yield engine
    engine.llm_engine.engine_core.shutdown()


def test_plain_vllm_serves_the_draft_greedy_equal_to_transformers_and_accepting_as_the_reference(llm, prompts):
    from transformers import Qwen2ForCausalLM

    reference = Qwen2ForCausalLM.from_pretrained(TARGET, torch_dtype=torch.float32).eval()
    engine = build_engine(TARGET, {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K},
                          EngineConfig(max_batch_size=16))
    embedded = engine.generate(samples_for_prompts(prompts), SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    total = [0] * K
    for prompt, s in zip(prompts, embedded):
        tokens, _, accepted = vllm_greedy(llm, prompt, MAX_NEW, K)
        assert tokens == hf_greedy(reference, prompt, MAX_NEW) == s.response_ids
        _, expected = reference_acceptance(engine.model, engine.proposer.draft_model, prompt, tokens, K, MAX_NEW,
                                           past_end=True)
        assert accepted == expected, (prompt, accepted, expected)
        total = [a + b for a, b in zip(total, accepted)]
    assert total[0] > 0 and total[-1] > 0  # drafts accepted at every position: not vacuous


# ---------------------------------------------------------------- sampled output on vLLM
N, ALPHA = 4000, 1e-3


@pytest.fixture(scope="module")
def backend():
    """The vLLM rollout backend (vLLM's eagle3 path, with the backend's repair of the CPU build's
    sampling kernel, and the in-place reload of target and drafter)."""
    from rollout.vllm.backend import VLLMBackend

    b = VLLMBackend(TARGET, {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K}, max_batch_size=256)
    yield b
    b.close()


@pytest.fixture(scope="module")
def vllm_eagle3_samples(backend):
    """N samples of 4 tokens after one prompt (the shipped draft, before any reload)."""
    prompt = TextCodec(TARGET).encode_prompt("37+58=", 1)
    samples = samples_for_prompts([prompt], n=N)
    backend.generate(samples, SamplingParams(temperature=1.0, max_new_tokens=4))
    return prompt, samples, backend.stats()["spec"]["draft_tokens"]


def test_vllm_sampled_eagle3_tokens_follow_the_policy(vllm_eagle3_samples):
    from spec_fixtures import chi_square_p_value, first_two_counts, hf_first_two_joint

    prompt, samples, drafted = vllm_eagle3_samples
    assert drafted > 0  # speculation really ran
    assert chi_square_p_value(first_two_counts(samples), hf_first_two_joint(TARGET, prompt, 1.0), N) > ALPHA


def test_the_vllm_distribution_test_rejects_a_distorted_policy(vllm_eagle3_samples):
    """Negative control: the same counts against the policy at temperature 1.3."""
    from spec_fixtures import chi_square_p_value, first_two_counts, hf_first_two_joint

    prompt, samples, _ = vllm_eagle3_samples
    assert chi_square_p_value(first_two_counts(samples), hf_first_two_joint(TARGET, prompt, 1.3), N) < ALPHA


def test_a_draft_reloaded_in_place_is_the_one_vllm_drafts_with(backend, prompts):
    """The online run's sync: new draft tensors (`eagle3.*`) reloaded into vLLM's drafter in place.
    Afterwards vLLM accepts per position exactly what the cache-free reference accepts with the NEW
    draft, its readable draft parameters (the norms) read back as sent, and the guard's draft
    checksum covers them."""

    from mtp.eagle3 import Eagle3Draft
    from vime.models.eagle3 import EAGLE3, resolve_aux_layers
    from vime.models.hf_format import read_config

    cfg, state = EAGLE3.load(DRAFT)
    changed = dict(state)
    changed["midlayer.mlp.down_proj.weight"] = state["midlayer.mlp.down_proj.weight"] * 0.5
    changed["norm.weight"] = state["norm.weight"] * 1.25
    backend.load_weights([(EAGLE3.wire_prefix + k, v) for k, v in changed.items()], version=1)
    draft = Eagle3Draft(resolve_aux_layers(cfg, read_config(TARGET)))
    draft.load_state_dict(changed)
    engine = build_engine(TARGET, None)
    readback = backend.weights.readback_stats
    assert torch.allclose(readback[EAGLE3.wire_prefix + "norm.weight"].float(),
                          torch.tensor([float(changed["norm.weight"].sum()), float(changed["norm.weight"].pow(2).sum())]),
                          rtol=1e-6)
    assert backend.fingerprint()["draft"] is not None
    total = [0] * K
    for prompt in prompts[:8]:
        samples = samples_for_prompts([prompt])
        backend.generate(samples, SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
        got = backend.stats()["spec"]["accepted_per_pos"]
        _, expected = reference_acceptance(engine.model, draft.eval(), prompt, samples[0].response_ids, K, MAX_NEW,
                                           past_end=True)
        assert got == expected, (prompt, got, expected)
        total = [a + b for a, b in zip(total, got)]
    assert total[0] > 0
