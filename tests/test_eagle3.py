"""What is EAGLE-3's own on the embedded engine (what every external kind does: test_external_draft_*.py,
test_draft_format.py): the aux hidden states it reads, vLLM's own aux-layer choice written down from its
source, a draft saved and loaded, the exact joint of the first three tokens while k switches between 0
and 2 (the deferral it shares with MTP). Bad targets are one line.
"""
import dataclasses
import json
import os

import pytest
import torch

from draft_kind_fixtures import random_draft, vocab_pair
from eagle3_fixtures import DRAFT, TARGET
from mtp.eagle3 import Eagle3Draft
from rollout.embedded.engine import Engine, EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.embedded.proposers.eagle3 import Eagle3Proposer
from rollout.sampling_params import SamplingParams
from vime.spec_config import check_against_checkpoint, parse_spec_config
from spec_fixtures import alternating_k, chi_square_p_value, exact_joint, one_thread  # noqa: F401
from vime.errors import UserError
from vime.models.eagle3 import EAGLE3, draft_config_for_target, vllm_default_aux_layer_ids
from vime.models.hf_format import read_config
from vime.sample import samples_for_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def spec(k, model=DRAFT, **extra):
    return {"method": "eagle3", "num_speculative_tokens": k, "model": model, **extra}


def test_aux_layers_are_vllms_default_choice():
    """vLLM's get_eagle3_default_aux_hidden_state_layers: (2, L // 2, L - 3) for an L-layer target
    (its source, vllm/model_executor/models/interfaces.py); the shipped draft writes them down."""
    assert vllm_default_aux_layer_ids(7) == (2, 3, 4)
    assert vllm_default_aux_layer_ids(28) == (2, 14, 25)
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


N, PROMPT, ALPHA = 20000, [0, 3, 1], 1e-3  # the k-switching distribution test (test_external_draft_distribution.py)


# ---------------------------------------------------------------- bad drafts and targets: one line each
def refusal(target, draft_dir):
    with pytest.raises(UserError) as e:
        check_against_checkpoint(parse_spec_config(spec(2, model=draft_dir)), read_config(target))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_new_draft_for_a_target_too_shallow_for_vllms_choice_reads_its_ends_and_middle():
    """vLLM's (2, L // 2, L - 3) names fewer than three layers below 7 (the tiny GLM-4.5 and DeepSeek-V3
    models have 5): a new draft then reads the embedding output, the middle and the last layer's output;
    a target of one layer has no three."""
    shallow = dataclasses.replace(read_config(TARGET), num_hidden_layers=5)
    assert draft_config_for_target(shallow).aux_layer_ids == (0, 2, 5)
    assert draft_config_for_target(read_config(TARGET)).aux_layer_ids == vllm_default_aux_layer_ids(7)
    with pytest.raises(UserError, match="3 distinct aux layers.*at least 2 layers"):
        draft_config_for_target(dataclasses.replace(shallow, num_hidden_layers=1))


def test_saved_draft_round_trips_and_loads_into_the_engine(tmp_path):
    """A draft saved in the EAGLE-3 format is what the engine loads (same drafts as the in-memory one)."""
    cfg = read_config(TARGET)
    draft = random_draft(EAGLE3, cfg, seed=0, std=0.05)
    EAGLE3.save(str(tmp_path / "d"), draft.cfg, draft.state_dict())
    engine = build_engine(TARGET, spec(2, model=str(tmp_path / "d")), EngineConfig(max_batch_size=32))
    loaded = engine.proposer.draft_model
    assert isinstance(loaded, Eagle3Draft)
    for (name, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_sampling_with_k_switching_per_step_follows_the_target_distribution():
    """A k policy alternating 0 and 2 makes the proposer defer steps and catch up over them later
    (the MTP proposer's deferral, which EAGLE-3 reuses); the distribution must not move."""
    target, draft = vocab_pair(EAGLE3)
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


