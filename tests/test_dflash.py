"""DFlash on the embedded engine: a block drafted in one forward, verified exactly.

References: plain decoding (greedy tokens and log-probs), an independent torch reference of
vLLM's DFlash computation on transformers' target states (tests/dflash_fixtures.py) for the
block logits, the packed training blocks and the accepted drafts per position, and the exact
joint distribution of a 5-token target for sampled output (chi-square, with a negative control).
"""
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from dflash_fixtures import DRAFT, REPO, TARGET, load_reference, reference_acceptance, reference_block_logits
from fp32_bounds import forward_depth, greedy_logprob_bound, max_logprob_diff, reduction_rtol
from mtp.dflash import DFlashDraft, block_logits
from rollout.embedded.engine import Engine, EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.embedded.proposers.dflash import DFlashProposer
from rollout.sampling_params import SamplingParams
from rollout.spec_config import check_against_checkpoint, parse_spec_config
from rollout.spec_stats import aggregate_spec_stats
from rollout.task import make_prompts
from rollout.tokenizer import TextCodec
from spec_fixtures import check_sampled_drafts_keep_the_target_distribution, \
    check_the_test_rejects_resampling_from_p, one_thread, tiny_vocab_model  # noqa: F401
from vime.errors import UserError
from vime.models.dflash import DFLASH, draft_config_for_target
from vime.models.hf_format import read_config
from vime.sample import samples_for_prompts

pytestmark = pytest.mark.usefixtures("one_thread")
K = 3  # the shipped draft's blocks: the anchor and 3 drafts
GREEDY = SamplingParams(temperature=0, max_new_tokens=40)


def spec(k=K, model=DRAFT, **extra):
    return {"method": "dflash", "num_speculative_tokens": k, "model": model, **extra}


@pytest.fixture(scope="module")
def prompts():
    codec = TextCodec(TARGET)
    return [codec.encode_prompt(r["prompt"], 1) for r in make_prompts(24, seed=5) + make_prompts(8, seed=6, digits=2)]


@pytest.fixture(scope="module")
def plain(prompts):
    return build_engine(TARGET, None, EngineConfig(max_batch_size=32)).generate(samples_for_prompts(prompts), GREEDY)


@pytest.fixture(scope="module")
def reference():
    return load_reference()


def test_greedy_dflash_equals_plain_decoding_with_equal_logprobs(prompts, plain):
    engine = build_engine(TARGET, spec(), EngineConfig(max_batch_size=32))
    got = engine.generate(samples_for_prompts(prompts), GREEDY)
    assert [s.response_ids for s in got] == [s.response_ids for s in plain]
    assert max_logprob_diff(got, plain) <= greedy_logprob_bound(TARGET, got)
    stats = aggregate_spec_stats(got)
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_accept_rate_pos_2"] > 0  # every block slot pays


def test_greedy_dflash_with_adaptive_k_equals_plain_decoding(prompts, plain):
    """--spec-adaptive prices the block forward with the proposer's probe and picks k per step;
    a step with fewer drafts reads the first slots of the same block: still exact."""
    engine = build_engine(TARGET, spec(), EngineConfig(max_batch_size=32), adaptive=True)
    got = engine.generate(samples_for_prompts(prompts), GREEDY)
    assert [s.response_ids for s in got] == [s.response_ids for s in plain]
    assert engine.profile_draft(4, K) > 0  # the probe really ran the draft


def test_a_step_without_drafts_is_priced_with_the_context_write_it_still_does(monkeypatch):
    """--spec-adaptive's k = 0 price: DFlash writes the verified positions into its context at every
    step, so the probe at k = 0 runs that write (and no block); at k >= 1 the write and one block.
    A proposer with nothing to do at k = 0 (MTP defers its catch-up) is priced at 0 there."""
    engine = build_engine(TARGET, spec(), EngineConfig(max_batch_size=8))
    calls = []
    for name in ("write_context", "block_logits"):
        original = getattr(engine.proposer, name)
        monkeypatch.setattr(engine.proposer, name,
                            lambda *a, _name=name, _f=original: calls.append(_name) or _f(*a))
    assert engine.profile_draft(4, 0, repeats=1) > 0
    assert set(calls) == {"write_context"}
    calls.clear()
    engine.profile_draft(4, K, repeats=1)
    assert set(calls) == {"write_context", "block_logits"}
    mtp = build_engine(os.path.join(REPO, "checkpoints", "tiny-mimo-mtp"), {"method": "mtp", "num_speculative_tokens": 1},
                       EngineConfig(max_batch_size=8))
    assert mtp.profile_draft(4, 0, repeats=1) == 0.0 and mtp.profile_draft(4, 1, repeats=1) > 0


class RecordingProposer(DFlashProposer):
    """The engine's proposer, keeping each block's logits with the tokens known when it was drafted."""

    records = None

    def propose(self, out):
        self.known = [list(r.all_ids) for r in out.requests]
        super().propose(out)

    def block_logits(self, slots, anchor_tokens, anchors):
        logits = super().block_logits(slots, anchor_tokens, anchors)
        self.records = (self.records or []) + list(zip(self.known, logits))
        return logits


def logits_tolerance(cfg, draft_cfg, logits):
    """fp32 reduction-order bound through the target's and the draft's layers, scaled by the logits."""
    longest = max(cfg.intermediate_size, len(draft_cfg.target_layer_ids) * cfg.hidden_size, cfg.max_position_embeddings)
    return reduction_rtol(longest, forward_depth(cfg.num_hidden_layers + draft_cfg.num_hidden_layers)) * \
        float(logits.abs().max())


@pytest.fixture(scope="module")
def two_layer_draft(tmp_path_factory):
    """A random two-layer draft (norms perturbed too, so each layer's own weights matter)."""
    torch.manual_seed(5)
    draft = DFlashDraft(draft_config_for_target(read_config(TARGET), num_layers=2, block_size=K + 1))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.05) if p.dim() == 2 else p.add_(torch.randn(p.shape) * 0.3)
    path = str(tmp_path_factory.mktemp("dflash") / "two-layer")
    DFLASH.save(path, draft.cfg, draft.state_dict())
    return path


@pytest.mark.parametrize("which", ["shipped", "two-layer"])
def test_block_logits_equal_an_independent_reference_of_vllms_dflash_model(which, prompts, reference, two_layer_draft):
    """Every block the engine drafted (cached context written step by step, ragged batches, moved
    slots) has the logits of vLLM's DFlash computation redone from scratch on transformers' states."""
    path = DRAFT if which == "shipped" else two_layer_draft
    sc = parse_spec_config(spec(model=path))
    proposer = RecordingProposer(sc)
    engine = Engine.from_checkpoint(TARGET, EngineConfig(max_batch_size=6), proposer)
    engine.generate(samples_for_prompts(prompts[:10]), GREEDY)
    target, state, cfg = reference if which == "shipped" else load_reference(path)
    assert len(proposer.records) >= 2 * 10  # several blocks per request, across steps and slots
    for known, logits in proposer.records:
        expected = reference_block_logits(target, state, cfg, known)
        tol = logits_tolerance(engine.cfg, proposer.draft_model.cfg, expected)
        assert (logits - expected).abs().max() <= tol, (known, float((logits - expected).abs().max()), tol)


def test_drafted_and_accepted_per_position_equal_the_cache_free_reference(prompts, reference):
    engine = build_engine(TARGET, spec(), EngineConfig(max_batch_size=32))
    samples = engine.generate(samples_for_prompts(prompts[:16]), GREEDY)
    total = [0] * K
    for s in samples:
        drafted, accepted = reference_acceptance(reference, s.prompt_ids, s.response_ids, GREEDY.max_new_tokens)
        got = (s.spec.drafted_per_pos + [0] * (K - len(s.spec.drafted_per_pos)),
               s.spec.accepted_per_pos + [0] * (K - len(s.spec.accepted_per_pos)))
        assert got == (drafted, accepted), s.index
        total = [a + b for a, b in zip(total, accepted)]
    assert all(total)  # accepted at every block slot: not vacuous


def test_packed_training_blocks_equal_the_reference_blocks(prompts, reference):
    """The training objective's blocks (several anchors of a sequence packed in one forward, each
    seeing only the context before its anchor) are the blocks inference drafts at those anchors."""
    engine = build_engine(TARGET, None)
    draft_cfg, draft_state = DFLASH.load(DRAFT)
    draft = DFlashDraft(draft_cfg)
    draft.load_state_dict(draft_state)
    target, state, cfg = reference
    ids = prompts[0] + engine.generate(samples_for_prompts(prompts[:1]), GREEDY)[0].response_ids
    tokens = torch.tensor([ids])
    anchors = torch.tensor([[3, len(prompts[0]), len(ids) - 6]])
    with torch.no_grad():
        aux = engine.model.aux_hidden_states(tokens, torch.arange(len(ids))[None], draft.cfg.aux_layer_ids)
        logits, _ = block_logits(draft, aux, tokens, anchors, torch.ones_like(anchors, dtype=torch.bool),
                                 engine.model.model.embed_tokens.weight, engine.model.head_weight())
    size = draft.cfg.block_size
    for n, a in enumerate(anchors[0].tolist()):
        expected = reference_block_logits(target, state, cfg, ids[:a + 1])
        got = logits[0, n * size:(n + 1) * size]
        assert (got - expected).abs().max() <= logits_tolerance(engine.cfg, draft.cfg, expected), a


# ---------------------------------------------------------------- sampled output: the target distribution
N, ALPHA = 20000, 1e-3  # samples after spec_fixtures.sampled_counts' prompt


@pytest.fixture(scope="module")
def vocab_pair():
    """A 5-token Qwen2 target without MTP and a random one-layer DFlash draft on its layers 0 and 1
    (blocks of 3: two drafts), norms perturbed too so that each matters."""
    from rollout.embedded.model import CausalLMWithMTP

    target = tiny_vocab_model(seed=1, family="qwen2", tie_word_embeddings=False)
    cfg = dataclasses.replace(target.cfg, num_nextn_predict_layers=0, pad_token_id=4)
    keep = {n: p for n, p in target.state_dict().items() if not n.startswith(f"model.layers.{cfg.num_hidden_layers}.")}
    model = CausalLMWithMTP(cfg)
    model.load_state_dict(keep)
    torch.manual_seed(3)
    draft = DFlashDraft(draft_config_for_target(cfg, num_layers=1, block_size=3, target_layer_ids=(0, 1)))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.35) if p.dim() == 2 else p.add_(torch.randn(p.shape) * 0.35)
    return model.eval(), draft.eval().requires_grad_(False)


def proposer(draft, method, sample_drafts):
    sc = parse_spec_config(spec(2, model="unused", rejection_sample_method=method))
    return DFlashProposer(sc, draft=draft, sample_drafts=sample_drafts)


@pytest.mark.parametrize("method, sample_drafts", [("probabilistic", True), ("strict", False)])
def test_sampled_dflash_output_follows_the_target_distribution(vocab_pair, method, sample_drafts):
    target, draft = vocab_pair
    check_sampled_drafts_keep_the_target_distribution(target, proposer(draft, method, sample_drafts), method, N,
                                                      ALPHA)


def test_the_distribution_test_rejects_a_sampler_that_resamples_from_p(vocab_pair, monkeypatch):
    target, draft = vocab_pair
    check_the_test_rejects_resampling_from_p(target, proposer(draft, "probabilistic", True), N, ALPHA, monkeypatch)


# ---------------------------------------------------------------- bad drafts and targets: one line each
def test_the_shipped_draft_is_in_vllms_format():
    with open(os.path.join(DRAFT, "config.json")) as f:
        raw = json.load(f)
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert raw["dflash_config"]["mask_token_id"] == read_config(TARGET).pad_token_id
    assert raw["block_size"] == K + 1


def copy_draft(tmp_path, edit_config=None, drop=None):
    out = tmp_path / "draft"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(DRAFT, out)
    if edit_config:
        raw = json.loads((out / "config.json").read_text())
        edit_config(raw)
        (out / "config.json").write_text(json.dumps(raw))
    if drop:
        (out / drop).unlink()
    return str(out)


def refusal(target, draft_dir, k=K):
    with pytest.raises(UserError) as e:
        check_against_checkpoint(parse_spec_config(spec(k, model=draft_dir)), read_config(target))
    assert "\n" not in str(e.value)
    return str(e.value)


def dflash_config(**changes):
    return lambda raw: raw["dflash_config"].update(changes)


def test_dflash_without_a_draft_is_refused():
    with pytest.raises(UserError, match="method 'dflash' needs \"model\".*make_dflash_draft.py"):
        parse_spec_config({"method": "dflash", "num_speculative_tokens": K})


def test_a_directory_that_is_not_a_draft_is_refused(tmp_path):
    assert "is not a DFlash draft" in refusal(TARGET, TARGET)
    assert "no such directory" in refusal(TARGET, str(tmp_path / "nowhere"))
    assert "model.safetensors is missing" in refusal(TARGET, copy_draft(tmp_path, drop="model.safetensors"))
    assert "lacks 'mask_token_id'" in refusal(TARGET, copy_draft(tmp_path, lambda raw: raw["dflash_config"].pop(
        "mask_token_id")))


def test_a_draft_that_does_not_fit_the_target_is_refused(tmp_path):
    assert "hidden size 256" in refusal(TARGET, copy_draft(tmp_path, lambda raw: raw.update(hidden_size=256)))
    assert "vocab_size 64" in refusal(TARGET, copy_draft(tmp_path, lambda raw: raw.update(vocab_size=64)))
    message = refusal(TARGET, copy_draft(tmp_path, dflash_config(target_layer_ids=[1, 3, 7])))
    assert "target_layer_ids [1, 3, 7]" in message and "7 layers" in message
    assert "mask_token_id 32" in refusal(TARGET, copy_draft(tmp_path, dflash_config(mask_token_id=32)))


def test_a_block_size_the_draft_was_not_built_for_is_refused():
    message = refusal(TARGET, DRAFT, k=5)
    assert "num_speculative_tokens 5" in message and f"blocks of {K + 1}" in message


def test_a_target_whose_vllm_model_gives_no_aux_hidden_states_is_refused():
    message = refusal(os.path.join(REPO, "checkpoints", "tiny-mimo-mtp"), DRAFT)
    assert "method 'dflash'" in message and "MiMoForCausalLM" in message and "qwen2 (Qwen2ForCausalLM)" in message


def test_make_dflash_draft_refuses_a_block_without_drafts_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/make_dflash_draft.py", "--target", TARGET, "--out",
                           str(tmp_path / "d"), "--block-size", "1"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("error: --block-size must be >= 2")
