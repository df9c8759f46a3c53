"""EAGLE-3's reduced draft vocabulary (vLLM's `d2t` format): a draft that predicts only some of the target's
tokens gives the full draft's logits at them and -inf elsewhere; on the embedded engine greedy decoding with it
is plain decoding's, accepting per position what the cache-free reference accepts; it trains in its own
vocabulary (each loss against its formula written out here, the whole-vocabulary loss the negative control);
its tables are saved and loaded as vLLM reads them, bad ones refused in one line naming the flag and the file;
the maker picks the tokens most frequent in its samples; and a trainer's sync leaves the rollout's draft the
trainer's, tables included.

References: the same draft with the whole vocabulary (its head's rows at the kept ids), plain decoding,
eagle3_fixtures' cache-free drafts, the formulas below, tables written out by hand (eagle3_fixtures).
"""
import collections
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from draft_kind_fixtures import acceptance_reference, edited_draft, random_draft
from eagle3_fixtures import DRAFT, REDUCED_IDS, REPO, TARGET, reduced_draft, save_reduced_shipped_draft
from fp32_bounds import close, greedy_logprob_bound, max_logprob_diff, reduction_rtol
from mtp.eagle3 import frequent_vocabulary, training_time_test, training_time_test_loss
from rollout.embedded.engine import EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.sampling_params import SamplingParams
from rollout.task import make_prompts
from rollout.tokenizer import TextCodec
from spec_fixtures import one_thread  # noqa: F401
from tests.bad_input_helpers import refused
from train_rl import prepare
from vime.cli_config import load_config
from vime.errors import UserError
from vime.models.eagle3 import EAGLE3
from vime.models.hf_format import read_config
from vime.sample import samples_for_prompts

pytestmark = pytest.mark.usefixtures("one_thread")
FLAG = "--vllm-speculative-config"
K = 3
GREEDY = SamplingParams(temperature=0, max_new_tokens=40)


@pytest.fixture(scope="module")
def reduced_dir(tmp_path_factory):
    """The shipped draft cut down to REDUCED_IDS, saved in the EAGLE-3 format."""
    return save_reduced_shipped_draft(tmp_path_factory.mktemp("eagle3_vocab") / "draft")


def left_out(vocab_size):
    out = torch.ones(vocab_size, dtype=torch.bool)
    out[list(REDUCED_IDS)] = False
    return out


# ---------------------------------------------------------------- the module
def test_reduced_logits_are_the_full_drafts_at_the_kept_ids_and_minus_inf_elsewhere():
    cfg = read_config(TARGET)
    full = random_draft(EAGLE3, cfg, seed=0, std=0.05)
    reduced = reduced_draft(full, REDUCED_IDS)
    torch.manual_seed(1)
    stream = torch.randn(4, 7, cfg.hidden_size)
    with torch.no_grad():
        want, got = full.logits(stream), reduced.logits(stream)
        terms = full.norm(stream).abs() @ full.lm_head.weight.abs().T  # each logit's sum of |terms|
    kept, out = list(REDUCED_IDS), left_out(cfg.vocab_size)
    assert got.shape == want.shape == (4, 7, cfg.vocab_size)
    # one dot product of `hidden_size` terms each side, in whatever order its matmul sums them
    assert ((got[..., kept] - want[..., kept]).abs() <= 2 * reduction_rtol(cfg.hidden_size, 1) * terms[..., kept]).all()
    assert torch.isneginf(got[..., out]).all() and torch.isfinite(want[..., out]).all()
    assert torch.softmax(got, -1)[..., out].eq(0).all()  # q: 0 outside the draft's vocabulary
    assert reduced.target_ids().tolist() == kept


def test_frequent_vocabulary_takes_the_most_frequent_ids_ties_to_the_lower_and_fills_with_the_lowest_unused():
    tokens = torch.tensor([5, 5, 3, 3, 7, 9, 9, 9])
    assert frequent_vocabulary(tokens, 2, 10).tolist() == [3, 9]  # 9 three times, then 3 before 5 (a tie)
    assert frequent_vocabulary(tokens, 4, 10).tolist() == [3, 5, 7, 9]
    assert frequent_vocabulary(tokens, 6, 10).tolist() == [0, 1, 3, 5, 7, 9]  # 4 seen, then the lowest unseen


# ---------------------------------------------------------------- the embedded engine
@pytest.fixture(scope="module")
def prompts():
    codec = TextCodec(TARGET)
    return [codec.encode_prompt(r["prompt"], 1) for r in make_prompts(24, seed=5) + make_prompts(8, seed=6, digits=2)]


def test_greedy_decoding_with_a_reduced_vocabulary_draft_is_plain_decoding_drafting_as_the_reference(reduced_dir,
                                                                                                    prompts):
    plain = build_engine(TARGET, None, EngineConfig(max_batch_size=32)).generate(samples_for_prompts(prompts), GREEDY)
    spec = {"method": "eagle3", "model": reduced_dir, "num_speculative_tokens": K}
    got = build_engine(TARGET, spec, EngineConfig(max_batch_size=32)).generate(samples_for_prompts(prompts), GREEDY)
    assert [s.response_ids for s in got] == [s.response_ids for s in plain]
    assert max_logprob_diff(got, plain) <= greedy_logprob_bound(TARGET, plain)
    reference, full = acceptance_reference(EAGLE3, reduced_dir), acceptance_reference(EAGLE3, DRAFT)
    total, differs = [0] * K, False
    for s in got:
        drafted, accepted = reference(s.prompt_ids, s.response_ids, GREEDY.max_new_tokens)
        assert ((s.spec.drafted_per_pos + [0] * K)[:K], (s.spec.accepted_per_pos + [0] * K)[:K]) == \
            (drafted, accepted), s.index
        total = [a + b for a, b in zip(total, accepted)]
        differs |= full(s.prompt_ids, s.response_ids, GREEDY.max_new_tokens)[1] != accepted
    # accepted at every position, and the whole-vocabulary draft would have accepted otherwise: not vacuous
    assert all(total) and differs


# ---------------------------------------------------------------- the loss
def direct_loss(logits, tokens, mask, policy, m, loss_type, temperature, topk):
    """Step m's loss of draft logits [B, T-1, V] over the whole vocabulary, written out position by position
    for a draft that has only REDUCED_IDS: its distribution over those, the policy's renormalised over them
    (top-k of them), `ce` counting only labels the draft has. (loss, positions counted, positions whose label
    it lacks)."""
    kept = list(REDUCED_IDS)
    total, counted, lacked = 0.0, 0, 0
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1] - m - 2):
            if not mask[b, t + m + 2]:
                continue
            label, draft = int(tokens[b, t + m + 2]), logits[b, t, kept].double()
            if loss_type == "ce":
                if label not in kept:
                    lacked += 1
                    continue
                total -= float(torch.log_softmax(draft, -1)[kept.index(label)])
            else:
                p_logits = policy[b, t + m + 1, kept].double() / temperature
                p_logits[p_logits < torch.topk(p_logits, topk).values[-1]] = float("-inf")
                p, logq = torch.softmax(p_logits, -1), torch.log_softmax(draft / temperature, -1)
                total += float(-(p[p > 0] * logq[p > 0]).sum() if loss_type == "soft_ce" else
                               0.5 * (p - logq.exp()).abs().sum())
            counted += 1
    return total / max(counted, 1), counted, lacked


@pytest.mark.parametrize("loss_type", ["ce", "soft_ce", "tv"])
def test_a_reduced_draft_trains_in_its_own_vocabulary(loss_type):
    cfg = read_config(TARGET)
    full = random_draft(EAGLE3, cfg, seed=0, std=0.05)
    reduced = reduced_draft(full, REDUCED_IDS)
    torch.manual_seed(2)
    b, n, steps, temperature, topk = 3, 10, 3, 0.7, 5
    embeds, aux = torch.randn(b, n, cfg.hidden_size), torch.randn(b, n, 3 * cfg.hidden_size)
    tokens = torch.randint(0, cfg.vocab_size, (b, n))
    mask = (torch.rand(b, n) > 0.2).float()
    policy = 2 * torch.randn(b, n, cfg.vocab_size)
    _, got = training_time_test_loss(reduced, embeds, aux, tokens, mask, steps, loss_type, policy, temperature, topk)
    _, whole = training_time_test_loss(full, embeds, aux, tokens, mask, steps, loss_type, policy, temperature, topk)
    with torch.no_grad():
        logits = training_time_test(full, embeds, aux, steps)  # the whole-vocabulary draft's, same weights
    # the head's dot products (hidden_size terms), then a softmax and a mean over at most b * n positions
    rtol = reduction_rtol(max(cfg.hidden_size, cfg.vocab_size, b * n), 4)
    lacked = 0
    for m in range(steps):
        want, counted, lacking = direct_loss(logits[m], tokens, mask, policy, m, loss_type, temperature, topk)
        assert counted > 0 and close(float(got[m]), want, rtol), (m, float(got[m]), want)
        assert not close(float(whole[m]), want, rtol)  # negative control: the whole vocabulary's loss differs
        lacked += lacking
    assert lacked > 0 or loss_type != "ce"  # some labels lay outside the draft's vocabulary: masked, not vacuous


# ---------------------------------------------------------------- the format
def test_a_reduced_draft_saves_and_loads_its_tables_as_vllm_reads_them(reduced_dir, tmp_path):
    with open(os.path.join(reduced_dir, "config.json")) as f:
        raw = json.load(f)
    assert (raw["draft_vocab_size"], raw["vocab_size"]) == (len(REDUCED_IDS), 32)
    tensors = load_file(os.path.join(reduced_dir, "model.safetensors"))
    ids = torch.tensor(REDUCED_IDS)
    assert tensors["d2t"].dtype == torch.int64 and torch.equal(tensors["d2t"] + torch.arange(len(ids)), ids)
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].nonzero().flatten().tolist() == list(REDUCED_IDS)
    assert tuple(tensors["lm_head.weight"].shape) == (len(ids), raw["hidden_size"])
    cfg, state = EAGLE3.load(reduced_dir)
    assert cfg.draft_vocab_size == len(ids) and cfg.vocab_size == 32
    module = EAGLE3.load_for_target(reduced_dir, read_config(TARGET), K)
    assert module.target_ids().tolist() == list(REDUCED_IDS)
    assert all(torch.equal(module.state_dict()[n], t) for n, t in tensors.items())
    EAGLE3.save(str(tmp_path / "again"), cfg, state)  # saved again: the same config and tensors
    assert EAGLE3.load(str(tmp_path / "again"))[0] == cfg
    # the shipped draft predicts the whole vocabulary: no tables
    shipped_cfg, shipped = EAGLE3.load(DRAFT)
    assert shipped_cfg.draft_vocab_size is None and "d2t" not in shipped and "t2d" not in shipped
    bad = dict(state, d2t=state["d2t"] - 5)  # draft id 0 would be target id -5
    with pytest.raises(UserError, match="nothing written.*d2t maps draft id 0 to target id -5"):
        EAGLE3.save(str(tmp_path / "bad"), cfg, bad)
    assert not (tmp_path / "bad").exists()


def args_for(out, draft, backend="embedded"):
    spec = {"method": "eagle3", "num_speculative_tokens": K, "model": str(draft)}
    return ["--hf-checkpoint", TARGET, "--num-rollout", "2", "--output-dir", str(out), "--rollout-backend", backend,
            "--vllm-speculative-config", json.dumps(spec)]


def _shift(state, i, by):
    state["d2t"][i] += by


BAD_DRAFTS = {  # edit -> what the one line says (besides the flag and the directory)
    "draft vocabulary above the target's": (dict(config=lambda raw: raw.update(draft_vocab_size=33)),
                                            ("draft_vocab_size 33 in config.json", "vocab_size 32")),
    "d2t past the vocabulary": (dict(tensors=lambda s: _shift(s, len(REDUCED_IDS) - 1, 20)),
                                (f"d2t maps draft id {len(REDUCED_IDS) - 1} to target id 42", "outside vocab_size 32",
                                 "model.safetensors")),
    "d2t repeating a target id": (dict(tensors=lambda s: _shift(s, 1, -1)),  # draft ids 0 and 1 both target id 0
                                  ("d2t maps 2 draft ids to target id 0", "model.safetensors")),
    "t2d disagreeing with d2t": (dict(tensors=lambda s: s["t2d"].__setitem__(9, True)),
                                 ("t2d disagrees with d2t at target id 9", "model.safetensors")),
    "no d2t": (dict(tensors=lambda s: s.pop("d2t")),
               ("model.safetensors does not hold what config.json describes", "first: d2t",
                "implied by draft_vocab_size")),
}


@pytest.mark.parametrize("case", BAD_DRAFTS)
def test_a_bad_reduced_vocabulary_is_refused_in_one_line_naming_the_flag_and_the_file(reduced_dir, tmp_path, case):
    edit, needles = BAD_DRAFTS[case]
    draft = edited_draft(tmp_path, EAGLE3, source=reduced_dir, **edit)
    refused(args_for(tmp_path, draft), FLAG, str(draft), *needles)


@pytest.mark.parametrize("backend", ["embedded", "vllm"])
def test_the_reduced_draft_passes_both_backends_preflight(reduced_dir, tmp_path, backend):
    prepare(load_config(args_for(tmp_path, reduced_dir, backend)))  # the negative control of the cases above


# ---------------------------------------------------------------- the maker
def make_eagle3_draft():
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import make_eagle3_draft as maker

    return maker


def test_the_maker_keeps_the_tokens_most_frequent_in_its_samples_responses_with_the_targets_head_rows(tmp_path):
    maker = make_eagle3_draft()
    out, n, samples = str(tmp_path / "draft"), 6, 24
    maker.main(["--target", TARGET, "--out", out, "--draft-vocab-size", str(n), "--warmup-steps", "0",
                "--warmup-samples", str(samples), "--max-new-tokens", "12"])
    # the same samples (same seed), counted here: response tokens from position 2 on
    sequences, prompt_lengths, _ = maker.target_samples(TARGET, samples, 12, 0)
    counts = collections.Counter(t for seq, p in zip(sequences, prompt_lengths) for i, t in enumerate(seq)
                                 if i >= max(p, 2))
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:n]
    want = sorted(ranked + [t for t in range(32) if t not in ranked][:n - len(ranked)])
    module = EAGLE3.load_for_target(out, read_config(TARGET), K)
    assert module.target_ids().tolist() == want
    from vime.models.hf_format import load_hf_checkpoint

    target_cfg, target_state, _ = load_hf_checkpoint(TARGET)
    head = target_state["model.embed_tokens.weight" if target_cfg.tie_word_embeddings else "lm_head.weight"]
    assert torch.equal(module.lm_head.weight, head[want])


@pytest.mark.parametrize("size", [0, -3, 33])
def test_the_maker_refuses_a_draft_vocabulary_outside_the_targets_in_one_line(tmp_path, capsys, size):
    maker = make_eagle3_draft()
    with pytest.raises(SystemExit) as e:
        maker.main(["--target", TARGET, "--out", str(tmp_path / "d"), "--draft-vocab-size", str(size)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(err) == 1 and f"--draft-vocab-size {size}" in err[0] and "32" in err[0], err
    assert not (tmp_path / "d").exists()


# ---------------------------------------------------------------- the trainer's sync
def test_a_sync_leaves_the_rollouts_reduced_draft_the_trainers_tables_included(tmp_path):
    """The trainer sends the draft's parameters (its tables never train); after a step and a sync the embedded
    rollout's draft holds exactly the trainer's tensors, d2t and t2d as both loaded them."""
    from rollout.backend import EmbeddedBackend
    from trainer.config import TrainerConfig
    from trainer.trainer import Trainer
    from trainer_fixtures import make_batch, make_tiny
    from vime.spec_config import parse_spec_config

    target = str(tmp_path / "target")
    make_tiny(target, seed=1, family="qwen2", num_nextn_predict_layers=0)
    draft = reduced_draft(random_draft(EAGLE3, read_config(target), seed=2, std=0.05, layers=(0, 1, 2)), REDUCED_IDS)
    EAGLE3.save(str(tmp_path / "draft"), draft.cfg, draft.state_dict())
    spec = {"method": "eagle3", "model": str(tmp_path / "draft"), "num_speculative_tokens": K}
    trainer = Trainer(TrainerConfig(enable_draft_training=True, speculative_config=parse_spec_config(spec)), target)
    rollout = EmbeddedBackend(target, spec, 8)
    trainer.train_step(make_batch())
    sent = [(n, t.detach().clone()) for n, t in trainer.named_hf_weights()]
    assert {n for n, _ in sent if n.startswith(EAGLE3.wire_prefix)} == \
        {EAGLE3.wire_prefix + n for n, _ in trainer.draft.module.named_parameters()}  # the tables stay home
    rollout.load_weights(sent, version=1)
    mine, theirs = trainer.draft.module.state_dict(), rollout.engine.proposer.draft_model.state_dict()
    assert mine.keys() == theirs.keys() and {"d2t", "t2d"} <= set(mine)
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    assert not torch.equal(theirs["fc.weight"], draft.fc.weight)  # the step moved the draft: not vacuous
