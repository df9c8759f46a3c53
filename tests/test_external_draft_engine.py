"""Every external draft kind on the embedded engine, with its shipped draft for the shipped Qwen2 target:
exact, and drafting as the kind's cache-free reference does; and on every other family's shipped model
(MiMo, GLM-4.5 MoE, DeepSeek-V3 MLA) with a draft made for it: exact.

References: plain decoding of the same prompts (greedy tokens, and log-probs within the fp32 bound),
also with k chosen per step (--spec-adaptive); the kind's draft recomputed from scratch at every
verify step without any cache (draft_kind_fixtures.acceptance_reference: drafted and accepted per
position, per request).
"""
import os

import pytest

from draft_kind_fixtures import (REPO, TARGET, acceptance_reference, shipped_draft, shipped_k, shipped_spec,
                                 warmed_up_draft)
from fp32_bounds import greedy_logprob_bound, max_logprob_diff
from rollout.embedded.engine import EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.sampling_params import SamplingParams
from rollout.spec_stats import aggregate_spec_stats
from rollout.task import make_prompts
from rollout.tokenizer import TextCodec
from spec_fixtures import one_thread  # noqa: F401
from vime.models.draft_kinds import EXTERNAL_KINDS
from vime.sample import samples_for_prompts

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(temperature=0, max_new_tokens=40)
FAMILY_GREEDY = SamplingParams(temperature=0, max_new_tokens=16)
# each kind at the k its shipped draft serves, and a chain draft also at k = 1
KIND_AND_K = [(kind, k) for kind in EXTERNAL_KINDS for k in sorted({shipped_k(kind)} | (set() if kind.block else {1}))]


@pytest.fixture(scope="module")
def prompts():
    codec = TextCodec(TARGET)
    return [codec.encode_prompt(r["prompt"], 1) for r in make_prompts(24, seed=5) + make_prompts(8, seed=6, digits=2)]


@pytest.fixture(scope="module")
def plain(prompts):
    return build_engine(TARGET, None, EngineConfig(max_batch_size=32)).generate(samples_for_prompts(prompts), GREEDY)


@pytest.mark.parametrize("kind, k", KIND_AND_K, ids=lambda v: getattr(v, "name", f"k{v}"))
def test_greedy_decoding_with_each_kinds_draft_equals_plain_decoding_with_equal_logprobs(kind, k, prompts, plain):
    engine = build_engine(TARGET, shipped_spec(kind, num_speculative_tokens=k), EngineConfig(max_batch_size=32))
    got = engine.generate(samples_for_prompts(prompts), GREEDY)
    assert [s.response_ids for s in got] == [s.response_ids for s in plain]
    assert max_logprob_diff(got, plain) <= greedy_logprob_bound(TARGET, plain)
    assert aggregate_spec_stats(got)["spec_accepted_tokens"] > 0  # drafts were really accepted


@pytest.mark.parametrize("kind", EXTERNAL_KINDS, ids=lambda kind: kind.name)
def test_greedy_decoding_with_k_chosen_per_step_equals_plain_decoding(kind, prompts, plain):
    """--spec-adaptive profiles the kind's drafter (its own probe) and picks k per step: still exact."""
    engine = build_engine(TARGET, shipped_spec(kind), EngineConfig(max_batch_size=32), adaptive=True)
    got = engine.generate(samples_for_prompts(prompts), GREEDY)
    assert [s.response_ids for s in got] == [s.response_ids for s in plain]
    assert engine.profile_draft(4, shipped_k(kind)) > 0  # the probe really ran the draft


@pytest.mark.parametrize("kind", EXTERNAL_KINDS, ids=lambda kind: kind.name)
def test_cached_drafting_accepts_what_the_cache_free_reference_accepts_per_position(kind, prompts):
    """Per request and per draft position, the engine's drafted/accepted counts equal those of the draft
    recomputed from scratch at every verify step (no KV cache, no catch-up, no context cache)."""
    k, reference = shipped_k(kind), acceptance_reference(kind, shipped_draft(kind))
    engine = build_engine(TARGET, shipped_spec(kind), EngineConfig(max_batch_size=32))
    samples = engine.generate(samples_for_prompts(prompts[:16]), GREEDY)
    total = [0] * k
    for s in samples:
        drafted, accepted = reference(s.prompt_ids, s.response_ids, GREEDY.max_new_tokens)
        got = ((s.spec.drafted_per_pos + [0] * k)[:k], (s.spec.accepted_per_pos + [0] * k)[:k])
        assert got == (drafted, accepted), s.index
        total = [a + b for a, b in zip(total, accepted)]
    assert all(total)  # accepted at every draft position: not vacuous


# ---------------------------------------------------------------- every family the engine runs
OTHER_FAMILIES = ("mimo", "glm4_moe", "deepseek_v3")  # targets beside Qwen2: MTP layers, MoE, MLA
FAMILY_K = 3


@pytest.fixture(scope="module", params=OTHER_FAMILIES)
def family_target(request):
    """(checkpoint, embedded engine on it, its greedy outputs of 4 task prompts) of the family's shipped model."""
    path = os.path.join(REPO, "checkpoints", f"tiny-{request.param.replace('_', '-')}-mtp")
    codec = TextCodec(path)
    prompts = [codec.encode_prompt(r["prompt"], 1) for r in make_prompts(4, seed=5)]
    engine = build_engine(path, None, EngineConfig(max_batch_size=8))
    return path, engine, engine.generate(samples_for_prompts(prompts), FAMILY_GREEDY)


@pytest.mark.parametrize("kind", EXTERNAL_KINDS, ids=lambda kind: kind.name)
def test_greedy_decoding_with_an_external_draft_equals_plain_decoding_on_every_family(family_target, kind, tmp_path):
    """An external draft drafts for any family's target on the embedded engine (vLLM's limit to Qwen2/Qwen3
    is the vLLM backend's own check): a draft fitted to the target's outputs, saved in its kind's format
    and served from there, leaves greedy decoding plain decoding's, token for token."""
    path, plain_engine, plain = family_target
    draft = warmed_up_draft(kind, plain_engine.model, [s.prompt_ids + s.response_ids for s in plain], FAMILY_K)
    kind.save(str(tmp_path / "draft"), draft.cfg, draft.state_dict())
    spec = {"method": kind.name, "model": str(tmp_path / "draft"), "num_speculative_tokens": FAMILY_K}
    got = build_engine(path, spec, EngineConfig(max_batch_size=8)).generate(
        samples_for_prompts([s.prompt_ids for s in plain]), FAMILY_GREEDY)
    assert [s.response_ids for s in got] == [s.response_ids for s in plain]
    assert max_logprob_diff(got, plain) <= greedy_logprob_bound(path, plain)
    assert aggregate_spec_stats(got)["spec_accepted_tokens"] > 0  # drafts were really accepted
