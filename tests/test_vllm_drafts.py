"""Every external draft kind's shipped draft as plain vLLM serves it (no vime code between), and the
vLLM rollout backend drafting with it and reloading it in place, on the shipped Qwen2 target.

References: transformers' Qwen2ForCausalLM (greedy tokens); the kind's draft recomputed from scratch at
every verify step (draft_kind_fixtures.acceptance_reference: drafting steps and accepted drafts per
position, counted as vLLM counts them, and as the embedded engine counts them for its own run); the exact
joint of the first two tokens (transformers) for sampled output, by a chi-square test with the policy at
temperature 1.3 as the negative control. The online run's sync: new draft tensors, sent as
`<kind>.<checkpoint name>`, reloaded into vLLM's drafter in place; afterwards vLLM accepts what the
reference accepts with the NEW draft (which the old one would not), its readable draft parameters read
back as sent, and the guard's draft checksum covers them. EAGLE-3 also with the shipped draft cut down to a
reduced vocabulary (vLLM's `d2t` format: its head's rows at 16 of the 32 tokens): vLLM reads its tables and
drafts as the reference does, and a reload of its trained tensors leaves them as loaded.
Two vLLM starts per draft (20-60 s each on 2 busy cores): the slow run.
"""
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("vllm")

from draft_kind_fixtures import TARGET, acceptance_reference, shipped_draft, shipped_k, shipped_spec  # noqa: E402
from eagle3_fixtures import save_reduced_shipped_draft  # noqa: E402
from fp32_bounds import reduction_rtol  # noqa: E402
from rollout.embedded.engine import EngineConfig  # noqa: E402
from rollout.embedded.engine_builder import build_engine  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from vime.models.draft_kinds import EXTERNAL_KINDS  # noqa: E402
from vime.models.eagle3 import EAGLE3  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402
from vllm_spec_fixtures import first_two_p_value, hf_greedy, sample_first_tokens, serve, task_prompts, \
    vllm_greedy  # noqa: E402

pytestmark = pytest.mark.slow
MAX_NEW, N, ALPHA = 32, 4000, 1e-3


@dataclass(frozen=True)
class Served:
    """A draft served: its kind, its directory and the drafts per step it serves."""

    kind: object
    draft: str
    k: int

    @property
    def spec(self):
        return shipped_spec(self.kind, model=self.draft)


# the kinds the CPU build of vLLM drafts (DSpark it drafts only in its GPU runner: tests/test_dspark_vllm.py
# checks its format against vLLM's model class and its refusal, tests/gpu serves it), each kind's shipped
# draft, and EAGLE-3's cut down to a reduced vocabulary
SERVED = [(k.name, k) for k in EXTERNAL_KINDS if not k.vllm_gpu_runner_only] + [("eagle3-vocab16", EAGLE3)]


@pytest.fixture(scope="module", params=SERVED, ids=lambda case: case[0])
def served(request, tmp_path_factory):
    name, kind = request.param
    draft = shipped_draft(kind) if name == kind.name else save_reduced_shipped_draft(
        tmp_path_factory.mktemp(name) / "draft")
    return Served(kind, draft, shipped_k(kind))


@pytest.fixture(scope="module")
def prompts():
    return task_prompts(TARGET)


@pytest.fixture(scope="module")
def llm(served):
    engine = serve(TARGET, served.spec)
    yield engine
    engine.llm_engine.engine_core.shutdown()


def test_plain_vllm_serves_each_kinds_draft_greedy_equal_to_transformers_accepting_as_the_reference(served, llm,
                                                                                                     prompts):
    from transformers import Qwen2ForCausalLM

    hf = Qwen2ForCausalLM.from_pretrained(TARGET, torch_dtype=torch.float32).eval()
    k, reference = served.k, acceptance_reference(served.kind, served.draft)
    engine = build_engine(TARGET, served.spec, EngineConfig(max_batch_size=16))
    embedded = engine.generate(samples_for_prompts(prompts), SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    total = [0] * k
    for prompt, s in zip(prompts, embedded):
        tokens, steps, accepted = vllm_greedy(llm, prompt, MAX_NEW, k)
        assert tokens == hf_greedy(hf, prompt, MAX_NEW) == s.response_ids
        drafted, expected = reference(prompt, tokens, MAX_NEW, past_end=True)  # vLLM drafts k past the budget too
        assert (steps, accepted) == (drafted[0], expected), (prompt, steps, accepted, drafted, expected)
        own_drafted, own_accepted = reference(prompt, tokens, MAX_NEW)
        assert ((s.spec.drafted_per_pos + [0] * k)[:k], (s.spec.accepted_per_pos + [0] * k)[:k]) == \
            (own_drafted, own_accepted)
        total = [a + b for a, b in zip(total, accepted)]
    assert all(total)  # drafts accepted at every position: not vacuous


# ---------------------------------------------------------------- the vLLM rollout backend
@pytest.fixture(scope="module")
def backend(served):
    """The vLLM rollout backend drafting with the served draft (its repairs of the CPU build, the in-place
    reload of target and drafter)."""
    from rollout.vllm.backend import VLLMBackend

    b = VLLMBackend(TARGET, served.spec, max_batch_size=256)
    yield b
    b.close()


@pytest.fixture(scope="module")
def sampled(backend):
    """N samples of 4 tokens after one prompt with the served draft (before any reload)."""
    return sample_first_tokens(backend, TARGET, N)


def test_vllm_sampled_tokens_with_each_kinds_draft_follow_the_policy(sampled):
    assert sampled[2] > 0  # speculation really ran
    assert first_two_p_value(TARGET, sampled, 1.0) > ALPHA


def test_the_vllm_distribution_test_rejects_a_distorted_policy(sampled):
    """Negative control: the same counts against the policy at temperature 1.3."""
    assert first_two_p_value(TARGET, sampled, 1.3) < ALPHA


def changed_draft(state):
    """The draft's tensors with its MLP output, context projection and key projection scaled by 0.7 and
    its final norm, context norm and key norm by 1.25 (those a kind has)."""
    factors = {"mlp.down_proj.weight": 0.7, "fc.weight": 0.7, "self_attn.k_proj.weight": 0.7,
               "hidden_norm.weight": 1.25, "self_attn.k_norm.weight": 1.25}
    changed = {n: t * next((f for end, f in factors.items() if n.endswith(end)), 1.0) for n, t in state.items()}
    changed["norm.weight"] = state["norm.weight"] * 1.25
    return changed


def trained(kind, cfg, state):
    """The tensors of `state` a trainer trains and sends: the draft module's parameters (no fixed tables)."""
    with torch.device("meta"):
        names = {n for n, _ in kind.format.model(cfg).named_parameters()}
    return {n: t for n, t in state.items() if n in names}


def test_a_draft_reloaded_in_place_is_the_one_vllm_drafts_with(served, backend, sampled, prompts):
    kind = served.kind
    cfg, state = kind.load(served.draft)
    changed = changed_draft(trained(kind, cfg, state))
    backend.load_weights([(kind.wire_prefix + n, t) for n, t in changed.items()], version=1)
    norm, readback = changed["norm.weight"], backend.weights.readback_stats
    # the worker sums in float64, the reference in fp32: one fp32 reduction over the norm's terms
    assert torch.allclose(readback[kind.wire_prefix + "norm.weight"].float(),
                          torch.tensor([float(norm.sum()), float(norm.pow(2).sum())]),
                          rtol=reduction_rtol(norm.numel(), 1), atol=0)
    assert backend.fingerprint()["draft"] is not None
    k = served.k
    new, old = acceptance_reference(kind, served.draft, {**state, **changed}), acceptance_reference(kind, served.draft)
    total, differs = [0] * k, False
    for prompt in prompts[:8]:
        samples = samples_for_prompts([prompt])
        backend.generate(samples, SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
        got = (backend.stats()["spec"]["accepted_per_pos"] + [0] * k)[:k]
        _, expected = new(prompt, samples[0].response_ids, MAX_NEW, past_end=True)
        assert got == expected, (prompt, got, expected)
        differs |= old(prompt, samples[0].response_ids, MAX_NEW, past_end=True)[1] != expected
        total = [a + b for a, b in zip(total, got)]
    assert total[0] > 0 and differs  # accepted, and the old draft would have accepted otherwise: not vacuous
