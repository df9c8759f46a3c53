"""The embedded engine's steps as CUDA graphs (skipped without CUDA).

On CUDA the engine captures every decode / verify / draft step once per padded shape and replays
it. References: the same engine with `enforce_eager` (no graphs, each batch at its own shape) —
greedy tokens equal for every proposer, log-probs within the fp32 bound of a reordered reduction;
each prompt decoded alone (no padding) for the padded batches; a fresh eager engine for weights
loaded after capture. fp32, so a reordered reduction cannot flip a greedy choice on these peaked
models. Run on a CUDA machine with `python -m pytest tests/gpu`.
"""
import os

import pytest
import torch

from draft_kind_fixtures import TARGET as QWEN2_TARGET
from draft_kind_fixtures import shipped_k, shipped_spec
from dspark_fixtures import record_sizes_at_fixed_prices
from fp32_bounds import greedy_logprob_bound, max_logprob_diff
from rollout.embedded.engine import EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.sampling_params import SamplingParams
from rollout.task import make_prompts
from rollout.tokenizer import TextCodec
from spec_fixtures import markov_model, qwen2_draft_specs, save_checkpoint
from vime.sample import samples_for_prompts

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = cuda
CHECKPOINTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "checkpoints")


def config(**extra):
    return EngineConfig(max_batch_size=16, device="cuda", attention_backend="sdpa", **extra)


def prompts_of(ckpt, n, seed=11):
    codec = TextCodec(ckpt)
    return [[1] + codec.encode(r["prompt"]) for r in make_prompts(n, seed=seed)]


def greedy(engine, prompts, max_new_tokens=24):
    return engine.generate(samples_for_prompts(prompts), SamplingParams(temperature=0, max_new_tokens=max_new_tokens))


@pytest.fixture(scope="module")
def markov_ckpt(tmp_path_factory):
    return save_checkpoint(markov_model(noise=0.2), str(tmp_path_factory.mktemp("graphs")))


def assert_graphs_equal_eager(ckpt, spec, prompts, **extra):
    eager = greedy(build_engine(ckpt, spec, config(enforce_eager=True)), prompts)
    engine = build_engine(ckpt, spec, config(**extra))
    got = greedy(engine, prompts)
    assert engine.steps.captured  # the steps ran as CUDA graphs
    assert [s.response_ids for s in got] == [s.response_ids for s in eager]
    assert max_logprob_diff(got, eager) <= greedy_logprob_bound(ckpt, eager)
    return engine


@pytest.mark.parametrize("spec", [None, {"method": "mtp", "num_speculative_tokens": 1},
                                  {"method": "mtp", "num_speculative_tokens": 3}], ids=["plain", "mtp-1", "mtp-3"])
def test_graphed_steps_decode_as_eager_steps_token_for_token(markov_ckpt, spec):
    assert_graphs_equal_eager(markov_ckpt, spec, prompts_of(markov_ckpt, 12))


@pytest.mark.parametrize("spec", qwen2_draft_specs(), ids=lambda s: s["method"])
def test_graphed_draft_steps_of_every_proposer_decode_as_eager_steps(spec):
    assert_graphs_equal_eager(QWEN2_TARGET, spec, prompts_of(QWEN2_TARGET, 12, seed=5))


def test_graphed_confidence_sized_dspark_decodes_as_graphed_plain_decoding():
    """enable_adaptive_verification on CUDA graphs: steps verify fewer drafts than drafted at some rows'
    steps (the verify graphs of several sizes), and greedy output is plain decoding's, graphed or eager."""
    from vime.models.draft_kinds import DRAFT_KINDS

    k = shipped_k(DRAFT_KINDS["dspark"])
    prompts = prompts_of(QWEN2_TARGET, 12, seed=5)
    plain = greedy(build_engine(QWEN2_TARGET, None, config()), prompts)
    for extra in ({}, {"enforce_eager": True}):
        engine = build_engine(QWEN2_TARGET, shipped_spec(DRAFT_KINDS["dspark"], enable_adaptive_verification=True),
                              config(**extra))
        sizes = record_sizes_at_fixed_prices(engine, k, 16)  # they follow the confidences, not this GPU's timings
        assert [s.response_ids for s in greedy(engine, prompts)] == [s.response_ids for s in plain]
        assert min(sizes) < k and max(sizes) > 0  # sized, not all or nothing
        assert bool(engine.steps.captured) != bool(extra)


def test_graphed_speculation_decodes_as_graphed_plain_decoding(markov_ckpt):
    prompts = prompts_of(markov_ckpt, 12)
    plain = greedy(build_engine(markov_ckpt, None, config()), prompts)
    spec = greedy(build_engine(markov_ckpt, {"method": "mtp", "num_speculative_tokens": 2}, config()), prompts)
    assert [s.response_ids for s in spec] == [s.response_ids for s in plain]


def test_padding_rows_up_to_a_bucket_changes_no_output(markov_ckpt):
    """11 prompts decode in padded batches (buckets 16, 8, ...) as each does alone (one row, no padding)."""
    prompts = prompts_of(markov_ckpt, 11)
    engine = build_engine(markov_ckpt, {"method": "mtp", "num_speculative_tokens": 2}, config())
    together = greedy(engine, prompts)
    assert any(key[1].rows > len(prompts) for key in engine.steps.captured if key[0] == "target")
    alone = [greedy(engine, [p])[0] for p in prompts]
    assert [s.response_ids for s in together] == [s.response_ids for s in alone]


def test_weights_loaded_after_capture_are_the_ones_graphs_read(markov_ckpt):
    prompts = prompts_of(markov_ckpt, 6)
    engine = build_engine(markov_ckpt, {"method": "mtp", "num_speculative_tokens": 2}, config())
    greedy(engine, prompts)
    perturbed = [(name, p + 0.05 * torch.randn_like(p)) for name, p in engine.model.named_parameters()
                 if "self_attn" in name or name.endswith("down_proj.weight")]
    engine.load_weights(perturbed, 1)
    reference = build_engine(markov_ckpt, {"method": "mtp", "num_speculative_tokens": 2}, config(enforce_eager=True))
    reference.load_weights(perturbed, 1)
    assert [s.response_ids for s in greedy(engine, prompts)] == [s.response_ids for s in greedy(reference, prompts)]


def test_a_reallocated_kv_cache_drops_the_graphs_and_decodes_the_same(markov_ckpt):
    prompts = prompts_of(markov_ckpt, 6)
    engine = build_engine(markov_ckpt, None, config())
    before = greedy(engine, prompts)
    engine.allocate_cache()
    assert not engine.steps.captured
    assert [s.response_ids for s in greedy(engine, prompts)] == [s.response_ids for s in before]


def test_compiled_graphed_steps_decode_as_eager_steps(markov_ckpt):
    assert_graphs_equal_eager(markov_ckpt, {"method": "mtp", "num_speculative_tokens": 2},
                              prompts_of(markov_ckpt, 6), compile_steps=True)


def test_mixture_of_experts_steps_run_eagerly_and_decode_as_enforce_eager():
    ckpt = os.path.join(CHECKPOINTS, "tiny-glm4-moe-mtp")
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    prompts = prompts_of(ckpt, 8)
    engine = build_engine(ckpt, spec, config())
    got = greedy(engine, prompts)
    assert not engine.steps.captured
    assert [s.response_ids for s in got] == [s.response_ids for s in greedy(build_engine(
        ckpt, spec, config(enforce_eager=True)), prompts)]


def test_bf16_graphed_decode_agrees_with_eager_on_nearly_every_prompt(markov_ckpt):
    """bf16 kernels at other batch shapes may flip a near-tie: nearly all prompts agree."""
    prompts = prompts_of(markov_ckpt, 16)
    outs = [[s.response_ids for s in greedy(build_engine(markov_ckpt, None, config(dtype=torch.bfloat16, **extra)),
                                            prompts)] for extra in ({}, {"enforce_eager": True})]
    assert sum(a == b for a, b in zip(*outs)) >= 0.9 * len(prompts)
