"""The engine's static steps: what a CUDA graph runs, checked where there is no CUDA.

On CUDA every decode / verify / draft step runs as a captured graph at a padded, fixed shape.
Here the same steps run with the `trace` capture (rollout/embedded/steps.py): each step traced
whole by torch.compile with fullgraph (a step that needs the host — `.item()`, `.tolist()`, a
data-dependent shape, a Python branch on a tensor — fails the trace), replayed from static input
copies into outputs shared by its family, rows padded to batch buckets and keys to length
buckets. References: the eager engine at the batch's own shape (itself checked against
transformers and plain decoding elsewhere) — greedy tokens equal, log-probs within the fp32
bound of a reordered reduction; the cache's own contents for what a padding row may write.
"""
import os

import pytest
import torch

from draft_kind_fixtures import TARGET as QWEN2_TARGET, warmed_up_draft
from fp32_bounds import greedy_logprob_bound, max_logprob_diff
from rollout.embedded.engine import EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.embedded.steps import MIN_KEY_BUCKET, StepRunner, key_bucket, row_bucket
from rollout.sampling_params import SamplingParams
from rollout.task import make_prompts
from rollout.tokenizer import TextCodec
from spec_fixtures import markov_model, one_thread, qwen2_draft_specs, save_checkpoint  # noqa: F401
from vime.models.draft_kinds import EXTERNAL_KINDS
from vime.models.families import MTP_FAMILIES
from vime.sample import samples_for_prompts

pytestmark = pytest.mark.usefixtures("one_thread")
CHECKPOINTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")
MOE_CHECKPOINTS = {name: os.path.join(CHECKPOINTS, f"tiny-{name}-mtp") for name in ("glm4-moe", "deepseek-v3")}


def traced(engine):
    """`engine` with its steps run as the stand-in for CUDA graphs (padded, traced whole, replayed)."""
    engine.steps = StepRunner("cpu", graphs=True, pad=engine.config.pad_to_buckets, max_rows=engine.config.max_batch_size,
                              capture="trace")
    engine.graph_query_windows(1 + engine.proposer.num_speculative_tokens)
    return engine


def prompts_of(ckpt, n, seed=11):
    codec = TextCodec(ckpt)
    return [[1] + codec.encode(r["prompt"]) for r in make_prompts(n, seed=seed)]


def generate(engine, prompts, max_new_tokens):
    return engine.generate(samples_for_prompts(prompts), SamplingParams(temperature=0, max_new_tokens=max_new_tokens))


def assert_same_decoding(ckpt, spec, prompts, max_new_tokens, max_batch_size, **config):
    """Greedy decoding with graph-shaped steps (and `spec`'s drafts) equals the plain eager
    engine's, token for token, log-probs within the fp32 bound."""
    eager = generate(build_engine(ckpt, None, EngineConfig(max_batch_size=max_batch_size)), prompts, max_new_tokens)
    engine = traced(build_engine(ckpt, spec, EngineConfig(max_batch_size=max_batch_size, **config)))
    got = generate(engine, prompts, max_new_tokens)
    assert [s.response_ids for s in got] == [s.response_ids for s in eager]
    assert max_logprob_diff(got, eager) <= greedy_logprob_bound(ckpt, eager)
    # the target's steps ran as (stand-in) graphs where they may (a mixture-of-experts model's run eagerly)
    assert any(key[0] == "target" for key in engine.steps.captured) == engine.graphable
    return engine, got


@pytest.fixture(scope="module")
def markov_ckpt(tmp_path_factory):
    return save_checkpoint(markov_model(noise=0.2), str(tmp_path_factory.mktemp("steps")))


def test_row_and_key_buckets_hold_every_size_and_stay_within_the_limits():
    for limit in (1, 5, 64, 100):
        buckets = [row_bucket(n, limit) for n in range(1, limit + 1)]
        assert all(n <= b <= limit for n, b in zip(range(1, limit + 1), buckets))
        assert buckets == sorted(buckets) and buckets[-1] == limit
    for n in range(1, 600):
        b = key_bucket(n, 513)
        assert b == 513 or (b >= max(n, MIN_KEY_BUCKET) and b & (b - 1) == 0 and b < 2 * max(n, MIN_KEY_BUCKET))


def test_a_padding_row_writes_only_its_slot_s_scratch_position(markov_ckpt):
    """A padded verify step of 3 real rows (bucket 4) changes the cache only at the real rows'
    new positions and at the padding row's scratch position."""
    engine = build_engine(markov_ckpt, None, EngineConfig(max_batch_size=8, max_len=32, pad_to_buckets=True))
    cache = engine.cache
    before = cache.k.clone()
    starts, rows = [5, 2, 7], [[4, 5], [6], [7, 8]]

    class Row:
        def __init__(self, slot):
            self.slot = slot

    engine._forward([Row(0), Row(1), Row(2)], rows, starts, with_logits=True)
    changed = (cache.k != before).any(-1).any(-1).any(0)  # [slots, positions]
    expected = torch.zeros_like(changed)
    for slot, (start, row) in enumerate(zip(starts, rows)):
        expected[slot, start:start + 2] = True  # the row's tokens, then stale entries up to the window (2)
    expected[3, cache.scratch_position] = True
    assert changed.tolist() == expected.tolist()


@pytest.mark.parametrize("method", ["none", "mtp"])
def test_graph_shaped_steps_decode_as_the_eager_engine_token_for_token(markov_ckpt, method):
    """Plain decoding and MTP speculation (k = 2, rows finishing at different steps so the
    batch is padded) with every step traced whole, padded and replayed."""
    spec = None if method == "none" else {"method": "mtp", "num_speculative_tokens": 2}
    prompts = prompts_of(markov_ckpt, 6)
    engine, _ = assert_same_decoding(markov_ckpt, spec, prompts, 10, 8)
    assert any(key[1].rows > 1 for key in engine.steps.captured)


def test_a_plain_engine_asked_for_verify_windows_runs_them_as_graphs(markov_ckpt):
    """The benchmarks time a plain engine's verifies of 2-4 tokens as a speculative engine runs them:
    graphed once asked (graph_query_windows), eagerly before."""
    engine = traced(build_engine(markov_ckpt, None, EngineConfig(max_batch_size=4)))

    def graphed_windows():
        return {key[1].q_len for key in engine.steps.captured if key[0] == "target"}

    for q in (1, 3):
        engine.profile_verify(1, q, repeats=1)
    assert graphed_windows() == {1}
    engine.graph_query_windows(4)
    engine.profile_verify(1, 3, repeats=1)
    assert graphed_windows() == {1, 3}


def test_graph_shaped_steps_read_the_weights_a_sync_loads_and_a_reallocated_cache(markov_ckpt):
    """Weights loaded after the graphs were captured (fused in place) and a re-allocated KV cache
    (graphs dropped) decode as a fresh eager engine does."""
    prompts = prompts_of(markov_ckpt, 4)
    engine = traced(build_engine(markov_ckpt, None, EngineConfig(max_batch_size=4)))
    generate(engine, prompts, 6)
    fused = [engine.fast.layers[0].qkv.packed, engine.fast.layers[0].qkv.dense]
    perturbed = [(name, p + 0.05 * torch.randn_like(p)) for name, p in engine.model.named_parameters()
                 if name.endswith("mlp.down_proj.weight") or "self_attn" in name]
    engine.load_weights(perturbed, 1)
    now = [engine.fast.layers[0].qkv.packed, engine.fast.layers[0].qkv.dense]
    assert all(a is b for a, b in zip(now, fused))  # the tensors a captured graph reads
    got = generate(engine, prompts, 8)
    reference = build_engine(markov_ckpt, None, EngineConfig(max_batch_size=4))
    reference.load_weights(perturbed, 1)
    want = generate(reference, prompts, 8)
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    engine.allocate_cache()
    assert not engine.steps.captured
    assert [s.response_ids for s in generate(engine, prompts, 8)] == [s.response_ids for s in want]


@pytest.fixture(scope="module", params=sorted(MTP_FAMILIES) + list(MOE_CHECKPOINTS))
def family_ckpt(request, tmp_path_factory):
    if request.param in MOE_CHECKPOINTS:
        return MOE_CHECKPOINTS[request.param]
    return save_checkpoint(markov_model(noise=0.2, family=request.param), str(tmp_path_factory.mktemp("family")))


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
def test_graph_shaped_mtp_steps_of_every_family_decode_as_the_eager_engine(family_ckpt, k):
    """Every family, the mixture-of-experts and latent-attention ones included: their steps run
    eagerly on CUDA (expert dispatch follows the routing's data); forced padding pads them here."""
    spec = {"method": "mtp", "num_speculative_tokens": k}
    prompts = prompts_of(family_ckpt, 10)
    assert_same_decoding(family_ckpt, spec, prompts, 16, 8)
    assert_same_decoding(family_ckpt, spec, prompts, 16, 8, pad_to_buckets=True)


@pytest.mark.slow
@pytest.mark.parametrize("spec", qwen2_draft_specs(), ids=lambda s: s["method"])
def test_graph_shaped_draft_steps_of_every_proposer_decode_as_the_eager_engine(spec):
    assert_same_decoding(QWEN2_TARGET, spec, prompts_of(QWEN2_TARGET, 10, seed=5), 24, 8)


@pytest.mark.slow
@pytest.mark.parametrize("kind", EXTERNAL_KINDS, ids=lambda kind: kind.name)
def test_graph_shaped_external_draft_steps_on_a_mixture_of_experts_target_decode_as_the_eager_engine(kind, tmp_path):
    """A dense external draft on GLM-4.5 (MoE): the target's steps run eagerly, the draft's as graphs."""
    path = MOE_CHECKPOINTS["glm4-moe"]
    prompts = prompts_of(path, 6)
    plain_engine = build_engine(path, None, EngineConfig(max_batch_size=8))
    plain = generate(plain_engine, prompts, 16)
    draft = warmed_up_draft(kind, plain_engine.model, [s.prompt_ids + s.response_ids for s in plain], 3)
    kind.save(str(tmp_path / "draft"), draft.cfg, draft.state_dict())
    engine, _ = assert_same_decoding(path, {"method": kind.name, "model": str(tmp_path / "draft"),
                                            "num_speculative_tokens": 3}, prompts, 16, 8)
    assert engine.steps.captured  # the draft's steps


@pytest.mark.slow
def test_graph_shaped_mtp_steps_with_k_chosen_per_step_decode_as_the_eager_engine(markov_ckpt):
    """Adaptive k: steps without drafts defer the MTP catch-up, whose window then outgrows a
    verify's and runs eagerly between graphed steps."""
    config = EngineConfig(max_batch_size=8)
    prompts = prompts_of(markov_ckpt, 12)
    eager = generate(build_engine(markov_ckpt, None, config), prompts, 20)
    engine = traced(build_engine(markov_ckpt, {"method": "mtp", "num_speculative_tokens": 2}, config))
    from test_spec_decode import CyclingK

    engine.k_policy = CyclingK(2)
    got = generate(engine, prompts, 20)
    assert [s.response_ids for s in got] == [s.response_ids for s in eager]


@pytest.mark.parametrize("name", list(MOE_CHECKPOINTS))
def test_padding_rows_leave_a_mixture_of_experts_model_s_tokens_and_routes_unchanged(name):
    """Padded steps of GLM-4.5 (MoE) and DeepSeek-V3 (MoE + latent attention) record the same
    routes and decode the same tokens as steps at the batch's own shape."""
    ckpt = MOE_CHECKPOINTS[name]
    prompts = prompts_of(ckpt, 5)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    runs = [generate(build_engine(ckpt, spec, EngineConfig(max_batch_size=8, pad_to_buckets=pad)), prompts, 10)
            for pad in (False, True)]
    assert [s.response_ids for s in runs[1]] == [s.response_ids for s in runs[0]]
    assert all(torch.equal(a.routed_experts, b.routed_experts) for a, b in zip(*runs))


def test_rollout_enforce_eager_reaches_both_rollout_engines(markov_ckpt):
    """--rollout-enforce-eager: the embedded engine captures no graphs, vLLM gets its enforce_eager."""
    from rollout.backend import build_backend
    from rollout.vllm.backend import engine_kwargs
    from vime.config import RolloutSection

    assert RolloutSection().enforce_eager is False
    backend = build_backend("embedded", markov_ckpt, None, 4, enforce_eager=True)
    assert backend.engine.config.enforce_eager and not backend.engine.steps.graphs
    assert engine_kwargs(markov_ckpt, None, 4, "cuda", enforce_eager=True)["enforce_eager"] is True
    assert "enforce_eager" not in engine_kwargs(markov_ckpt, None, 4, "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals are of a machine without CUDA")
@pytest.mark.parametrize("argv, needle", [(["--compile"], "--compile"), (["--device", "cuda"], "--device cuda")])
def test_the_step_limit_bench_refuses_an_arm_this_machine_cannot_run_in_one_line(argv, needle, capsys):
    from scripts.bench.throughput import main

    with pytest.raises(SystemExit) as stop:
        main(["step-limit", *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and needle in err
