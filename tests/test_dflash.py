"""What is DFlash's own on the embedded engine (what every external kind does: test_external_draft_*.py,
test_draft_format.py): the block logits and the packed training blocks against an independent torch
reference of vLLM's DFlash computation on transformers' target states (tests/dflash_fixtures.py), the
price of a step without drafts, the shipped draft's format, and its own config's bad inputs in one line.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from dflash_fixtures import DRAFT, REPO, TARGET, load_reference, reference_block_logits
from fp32_bounds import forward_depth, reduction_rtol
from mtp.dflash import DFlashDraft, block_logits
from rollout.embedded.engine import Engine, EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.embedded.proposers.dflash import DFlashProposer
from rollout.sampling_params import SamplingParams
from vime.spec_config import check_against_checkpoint, parse_spec_config
from rollout.task import make_prompts
from rollout.tokenizer import TextCodec
from spec_fixtures import one_thread  # noqa: F401
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
def reference():
    return load_reference()


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


# ---------------------------------------------------------------- bad drafts and targets: one line each
def test_the_shipped_draft_is_in_vllms_format():
    with open(os.path.join(DRAFT, "config.json")) as f:
        raw = json.load(f)
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert raw["dflash_config"]["mask_token_id"] == read_config(TARGET).pad_token_id
    assert raw["block_size"] == K + 1


def copy_draft(tmp_path, edit_config):
    out = tmp_path / "draft"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(DRAFT, out)
    raw = json.loads((out / "config.json").read_text())
    edit_config(raw)
    (out / "config.json").write_text(json.dumps(raw))
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


def test_a_config_without_the_dflash_keys_is_refused(tmp_path):
    assert "lacks 'mask_token_id'" in refusal(TARGET, copy_draft(tmp_path, lambda raw: raw["dflash_config"].pop(
        "mask_token_id")))


def test_a_draft_whose_target_layers_or_mask_token_the_target_lacks_is_refused(tmp_path):
    message = refusal(TARGET, copy_draft(tmp_path, dflash_config(target_layer_ids=[1, 3, 7])))
    assert "target_layer_ids [1, 3, 7]" in message and "7 layers" in message
    assert "mask_token_id is the integer 32" in refusal(TARGET, copy_draft(tmp_path, dflash_config(mask_token_id=32)))


def test_a_block_size_the_draft_was_not_built_for_is_refused():
    message = refusal(TARGET, DRAFT, k=5)
    assert "num_speculative_tokens 5" in message and f"blocks of {K + 1}" in message


def test_make_dflash_draft_refuses_a_block_without_drafts_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/make_dflash_draft.py", "--target", TARGET, "--out",
                           str(tmp_path / "d"), "--block-size", "1"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("error: --block-size must be >= 2")
