"""EAGLE-3 on the embedded engine: exact, and drafting as the cache-free reference does.

References: plain decoding (greedy tokens and log-probs), the draft recomputed from scratch at
every verify step without any cache (drafted/accepted per position), the exact joint
distribution of the first three tokens (chi-square, with a wrong sampler as negative control),
and vLLM's own aux-layer choice written down from its source. Bad drafts and targets are one line.
"""
import dataclasses
import json
import os
import shutil

import pytest
import torch

from fp32_bounds import greedy_logprob_bound, max_logprob_diff
from eagle3_fixtures import DRAFT, TARGET, random_draft, reference_acceptance
from mtp.eagle3 import Eagle3Draft
from rollout.embedded.engine import Engine, EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.embedded.proposers.eagle3 import Eagle3Proposer
from rollout.sampling_params import SamplingParams
from rollout.spec_config import check_against_checkpoint, parse_spec_config
from rollout.spec_stats import aggregate_spec_stats
from rollout.task import make_prompts
from rollout.tokenizer import TextCodec
from spec_fixtures import alternating_k, chi_square_p_value, exact_joint, check_sampled_drafts_keep_the_target_distribution, \
    check_the_test_rejects_resampling_from_p, one_thread, tiny_vocab_model  # noqa: F401
from vime.errors import UserError
from vime.models.eagle3 import default_aux_layer_ids, draft_config_for_target, save_draft
from vime.models.hf_format import read_config
from vime.sample import samples_for_prompts

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(temperature=0, max_new_tokens=40)


def spec(k, model=DRAFT, **extra):
    return {"method": "eagle3", "num_speculative_tokens": k, "model": model, **extra}


@pytest.fixture(scope="module")
def prompts():
    codec = TextCodec(TARGET)
    return [codec.encode_prompt(r["prompt"], 1) for r in make_prompts(24, seed=5) + make_prompts(8, seed=6, digits=2)]


@pytest.fixture(scope="module")
def plain(prompts):
    return build_engine(TARGET, None, EngineConfig(max_batch_size=32)).generate(samples_for_prompts(prompts), GREEDY)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_eagle3_equals_plain_decoding_with_equal_logprobs(k, prompts, plain):
    engine = build_engine(TARGET, spec(k), EngineConfig(max_batch_size=32))
    got = engine.generate(samples_for_prompts(prompts), GREEDY)
    assert [s.response_ids for s in got] == [s.response_ids for s in plain]
    assert max_logprob_diff(got, plain) <= greedy_logprob_bound(TARGET, plain)
    assert aggregate_spec_stats(got)["spec_accepted_tokens"] > 0  # drafts were really accepted


def test_cached_drafting_accepts_what_the_cache_free_reference_accepts_per_position(prompts):
    """Per request and per draft position, the engine's drafted/accepted counts equal those of
    the draft recomputed from scratch at every verify step (no KV cache, no catch-up)."""
    k = 3
    engine = build_engine(TARGET, spec(k), EngineConfig(max_batch_size=32))
    samples = engine.generate(samples_for_prompts(prompts), GREEDY)
    target, draft = engine.model, engine.proposer.draft_model
    accepted_anywhere = [0] * k
    for s in samples:
        drafted, accepted = reference_acceptance(target, draft, s.prompt_ids, s.response_ids, k, GREEDY.max_new_tokens)
        got_drafted = s.spec.drafted_per_pos + [0] * (k - len(s.spec.drafted_per_pos))
        got_accepted = s.spec.accepted_per_pos + [0] * (k - len(s.spec.accepted_per_pos))
        assert (got_drafted, got_accepted) == (drafted, accepted), s.index
        accepted_anywhere = [a + b for a, b in zip(accepted_anywhere, accepted)]
    assert accepted_anywhere[0] > 0 and accepted_anywhere[1] > 0  # the reuse steps are exercised too


def test_aux_layers_are_vllms_default_choice():
    """vLLM's get_eagle3_default_aux_hidden_state_layers: (2, L // 2, L - 3) for an L-layer target
    (its source, vllm/model_executor/models/interfaces.py); the shipped draft writes them down."""
    assert default_aux_layer_ids(7) == (2, 3, 4)
    assert default_aux_layer_ids(28) == (2, 14, 25)
    with open(os.path.join(DRAFT, "config.json")) as f:
        raw = json.load(f)
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]


def test_aux_hidden_states_are_the_residual_stream_before_each_layer():
    """id i is the input of target layer i (id 0: the embedding), as vLLM's _maybe_add_hidden_state."""
    engine = build_engine(TARGET, None)
    model = engine.model
    tokens = torch.tensor([[1, 5, 7, 9]])
    positions = torch.arange(4)[None]
    with torch.inference_mode():
        aux = model.aux_hidden_states(tokens, positions, (0, 2, 7))
        x = model.model.embed_tokens(tokens)
        inputs = [x]
        for layer in model.model.layers[:model.cfg.num_hidden_layers]:
            x = layer(x, positions, model.rotary)
            inputs.append(x)
    h = model.cfg.hidden_size
    assert torch.equal(aux[..., :h], inputs[0])
    assert torch.equal(aux[..., h:2 * h], inputs[2])
    assert torch.equal(aux[..., 2 * h:], inputs[7])


# ---------------------------------------------------------------- sampled output: the target distribution
N, PROMPT, ALPHA = 20000, [0, 3, 1], 1e-3


@pytest.fixture(scope="module")
def vocab_pair():
    """A 5-token Qwen2 target without MTP and a random EAGLE-3 draft on its layers 0, 1, 2."""
    target = tiny_vocab_model(seed=1, family="qwen2", tie_word_embeddings=False)
    target.cfg = dataclasses.replace(target.cfg, num_nextn_predict_layers=0)
    keep = {n: p for n, p in target.state_dict().items() if not n.startswith(f"model.layers.{target.cfg.num_hidden_layers}.")}
    from rollout.embedded.model import CausalLMWithMTP

    model = CausalLMWithMTP(target.cfg)
    model.load_state_dict(keep)
    return model.eval(), random_draft(model.cfg, seed=3, std=0.35, aux_layer_ids=(0, 1, 2))


def proposer(draft, method, sample_drafts):
    sc = parse_spec_config({"method": "eagle3", "num_speculative_tokens": 2, "model": "unused",
                            "rejection_sample_method": method})
    return Eagle3Proposer(sc, draft=draft, sample_drafts=sample_drafts)


@pytest.mark.parametrize("method, sample_drafts", [("probabilistic", True), ("strict", False)])
def test_sampled_eagle3_output_follows_the_target_distribution(vocab_pair, method, sample_drafts):
    target, draft = vocab_pair
    check_sampled_drafts_keep_the_target_distribution(target, proposer(draft, method, sample_drafts), method, N,
                                                      ALPHA)


def test_the_distribution_test_rejects_a_sampler_that_resamples_from_p(vocab_pair, monkeypatch):
    target, draft = vocab_pair
    check_the_test_rejects_resampling_from_p(target, proposer(draft, "probabilistic", True), N, ALPHA, monkeypatch)


# ---------------------------------------------------------------- bad drafts and targets: one line each
def copy_draft(tmp_path, edit_config=None, drop=None):
    out = tmp_path / "draft"
    shutil.copytree(DRAFT, out)
    if edit_config:
        raw = json.loads((out / "config.json").read_text())
        edit_config(raw)
        (out / "config.json").write_text(json.dumps(raw))
    if drop:
        (out / drop).unlink()
    return str(out)


def refusal(target, draft_dir):
    with pytest.raises(UserError) as e:
        check_against_checkpoint(parse_spec_config(spec(2, model=draft_dir)), read_config(target))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_directory_that_is_not_a_draft_is_refused(tmp_path):
    assert "is not an EAGLE-3 draft" in refusal(TARGET, TARGET)  # the target itself
    assert "no such directory" in refusal(TARGET, str(tmp_path / "nowhere"))
    assert "model.safetensors is missing" in refusal(TARGET, copy_draft(tmp_path, drop="model.safetensors"))


def test_a_draft_of_another_width_or_vocabulary_is_refused(tmp_path):
    wide = copy_draft(tmp_path, lambda raw: raw.update(hidden_size=256, target_hidden_size=256))
    assert "hidden size 256" in refusal(TARGET, wide)
    shutil.rmtree(wide)
    assert "vocab_size 64" in refusal(TARGET, copy_draft(tmp_path, lambda raw: raw.update(vocab_size=64,
                                                                                         draft_vocab_size=64)))


def test_a_target_whose_vllm_model_gives_no_aux_hidden_states_is_refused():
    message = refusal(os.path.join(os.path.dirname(TARGET), "tiny-mimo-mtp"), DRAFT)
    assert "MiMoForCausalLM" in message and "qwen2 (Qwen2ForCausalLM)" in message and "qwen3" in message


def test_a_draft_for_a_too_shallow_target_is_refused():
    cfg = dataclasses.replace(read_config(TARGET), num_hidden_layers=4)
    with pytest.raises(UserError, match="3 distinct aux layers"):
        draft_config_for_target(cfg)


def test_saved_draft_round_trips_and_loads_into_the_engine(tmp_path, prompts):
    """A draft saved by save_draft is what the engine loads (same drafts as the in-memory one)."""
    cfg = read_config(TARGET)
    draft = random_draft(cfg, seed=0, std=0.05)
    save_draft(str(tmp_path / "d"), draft.cfg, draft.state_dict())
    engine = build_engine(TARGET, spec(2, model=str(tmp_path / "d")), EngineConfig(max_batch_size=32))
    loaded = engine.proposer.draft_model
    assert isinstance(loaded, Eagle3Draft)
    for (name, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_sampling_with_k_switching_per_step_follows_the_target_distribution(vocab_pair):
    """A k policy alternating 0 and 2 makes the proposer defer steps and catch up over them later
    (the MTP proposer's deferral, which EAGLE-3 reuses); the distribution must not move."""
    target, draft = vocab_pair
    sc = parse_spec_config({"method": "eagle3", "num_speculative_tokens": 2, "model": "unused",
                            "rejection_sample_method": "probabilistic"})
    engine = Engine(target, EngineConfig(max_batch_size=1000, max_len=16), proposer=Eagle3Proposer(sc, draft=draft))
    engine.k_policy = alternating_k()
    samples = engine.generate(samples_for_prompts([PROMPT] * N), SamplingParams(temperature=1.0, max_new_tokens=3, seed=7))
    counts = {}
    for s in samples:
        counts[tuple(s.response_ids[:3])] = counts.get(tuple(s.response_ids[:3]), 0) + 1
    assert sum(s.spec.accepted_tokens for s in samples) > 0
    assert chi_square_p_value(counts, exact_joint(target), N) > ALPHA


def test_greedy_eagle3_with_adaptive_k_equals_plain_decoding(prompts, plain):
    """--spec-adaptive profiles the EAGLE-3 drafter (its own probe) and picks k per step: still exact."""
    engine = build_engine(TARGET, spec(3), EngineConfig(max_batch_size=32), adaptive=True)
    got = engine.generate(samples_for_prompts(prompts), GREEDY)
    assert [s.response_ids for s in got] == [s.response_ids for s in plain]
    assert engine.profile_draft(4, 3) > 0  # the probe really ran the draft
