"""What DSpark adds to a block draft, on the embedded engine (what every external kind shares, DSpark's
included, is checked by the kind-parametrized tests: test_external_draft_engine.py,
test_external_draft_distribution.py, test_draft_format.py, test_trainer_drafts.py).

References: an independent torch reference of vLLM's DSpark computation on transformers' target states
(tests/dspark_fixtures.py) for the block states, the Markov drafts and the confidences, also where
steps without drafts deferred the context; plain decoding under verification sized by confidence; the
exact joint distribution of a 5-token target for sampled output sized by each row's confidence
(chi-square), with a negative control that sizes by a draft's own value; direct formulas for the
verification size and the training loss.
"""
import dataclasses
import json
import math
import os
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

from dflash_fixtures import REPO, TARGET
from dspark_fixtures import DRAFT, load_reference, record_sizes_at_fixed_prices, reference_block
from fp32_bounds import forward_depth, reduction_rtol
from mtp.dflash import block_states
from mtp.dspark import DSparkDraft, dspark_loss
from rollout.embedded.engine import Engine, EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.embedded.proposers.dspark import DSparkProposer
from rollout.embedded.spec_policy import (ACCEPT_PRIOR_ROWS, DRAFT_MARGIN, AdaptiveK, ConfidenceSizedK, FixedK, ScheduleK,
                                          StepRecord, sized_q)
from rollout.sampling_params import SamplingParams
from vime.spec_config import check_against_checkpoint, parse_spec_config
from spec_fixtures import check_sampled_drafts_keep_the_target_distribution, one_thread  # noqa: F401
from test_external_draft_engine import plain, prompts  # noqa: F401  (the shipped target's prompts, plain decoded)
from vime.errors import UserError
from vime.models.dspark import DSPARK, draft_config_for_target
from vime.models.hf_format import read_config
from vime.sample import samples_for_prompts

pytestmark = pytest.mark.usefixtures("one_thread")
K = 3  # the shipped draft's blocks: 3 slots, each drafting a token
GREEDY = SamplingParams(temperature=0, max_new_tokens=40)


def spec(k=K, model=DRAFT, **extra):
    return {"method": "dspark", "num_speculative_tokens": k, "model": model, **extra}


@pytest.fixture(scope="module")
def reference():
    return load_reference()


def test_greedy_confidence_sized_verification_equals_plain_decoding(prompts, plain):
    """enable_adaptive_verification: the steps verify as many drafts as the confidence makes worth it
    (fewer than drafted at some steps), and the output is plain decoding's."""
    engine = build_engine(TARGET, spec(enable_adaptive_verification=True), EngineConfig(max_batch_size=32))
    sizes = record_sizes_at_fixed_prices(engine, K, 32)  # a profile of this machine would make them timing-dependent
    got = engine.generate(samples_for_prompts(prompts), GREEDY)
    assert [s.response_ids for s in got] == [s.response_ids for s in plain]
    assert min(sizes) < K and max(sizes) > 0  # sized, not all or nothing


SCHEDULE = [[1, 4, K], [5, 8, 1], [9, 32, 0]]
K_POLICIES = {"fixed": ({}, False), "schedule": ({"num_speculative_tokens_per_batch_size": SCHEDULE}, False),
              "adaptive": ({}, True), "sized": ({"enable_adaptive_verification": True}, False),
              "sized-schedule": ({"enable_adaptive_verification": True,
                                  "num_speculative_tokens_per_batch_size": SCHEDULE}, False)}


@pytest.mark.parametrize("policy", K_POLICIES)
def test_greedy_decoding_under_every_k_policy_equals_plain_decoding(prompts, plain, policy):
    """Each k policy DSpark can run under (a fixed k, vLLM's batch-size schedule, --spec-adaptive, sizing by
    confidence with and without a schedule), on this machine's own profile: plain decoding's tokens."""
    extra, adaptive = K_POLICIES[policy]
    engine = build_engine(TARGET, spec(**extra), EngineConfig(max_batch_size=32), adaptive=adaptive)
    got = engine.generate(samples_for_prompts(prompts), GREEDY)
    assert [s.response_ids for s in got] == [s.response_ids for s in plain]


class FixedKAskingConfidences(FixedK):
    """Fixed k that asks for the drafts' confidences (and verifies every draft): the reference tests compare them."""

    sizes_verification = True


class Alternating(FixedKAskingConfidences):
    """Draft at two steps of every three: the third defers the context write. It asks for the confidences (and
    verifies every draft), so the recording test sees them."""

    calls = 0

    def choose(self, batch_size):
        self.calls += 1
        return self.k if self.calls % 3 else 0


class RecordingProposer(DSparkProposer):
    """The engine's proposer, keeping each block's states, drafts and confidences with the tokens known."""

    def propose(self, out):
        self.known = [list(r.all_ids) for r in out.requests]
        self.step = {}
        super().propose(out)
        if self.step:
            self.drafting_steps += 1
            confidence = self.step["confidence"]
            self.records += list(zip(self.known, self.step["states"], [r.drafts for r in out.requests],
                                     [None] * len(self.known) if confidence is None else confidence))

    def catch_up(self, slots, hidden, starts, n_valid):
        self.deferred_rows += sum(self.written[s] < start for s, start in zip(slots, starts))  # context left to write
        super().catch_up(slots, hidden, starts, n_valid)

    def move_slots(self, requests, old_slots):
        # rows moved while states of theirs wait in `kept` for a catch-up (their kept rows swapped, not copied)
        self.moved_deferred += sum(self.written[o] < r.num_cached for r, o in zip(requests, old_slots))
        super().move_slots(requests, old_slots)

    def block_forward(self, slots, anchor_tokens, anchors, with_states=False):
        outputs = super().block_forward(slots, anchor_tokens, anchors, with_states)
        self.step["states"] = outputs[1].clone()
        return outputs

    def verification_size(self, batch_size, confidence, k):
        self.step["confidence"] = confidence
        return super().verification_size(batch_size, confidence, k)


def tolerance(cfg, draft_cfg, x):
    """fp32 reduction-order bound through the target's and the draft's layers, scaled by x."""
    longest = max(cfg.intermediate_size, len(draft_cfg.target_layer_ids) * cfg.hidden_size, cfg.max_position_embeddings)
    return reduction_rtol(longest, forward_depth(cfg.num_hidden_layers + draft_cfg.num_hidden_layers + 1)) * \
        float(x.detach().abs().max())


def recording_engine(max_batch_size):
    proposer = RecordingProposer(parse_spec_config(spec()))
    proposer.records, proposer.deferred_rows, proposer.moved_deferred = [], 0, 0
    proposer.drafting_steps = 0
    return Engine.from_checkpoint(TARGET, EngineConfig(max_batch_size=max_batch_size), proposer), proposer


def assert_blocks_equal_the_reference(proposer, engine, reference):
    """Every block the proposer recorded has the reference's states, its drafts where the reference's argmax is
    clear of the tolerance, and its confidences."""
    for known, states, drafts, confidence in proposer.records:
        want_states, want_drafts, want_logits, want_confidence = reference_block(reference, known)
        assert (states - want_states).abs().max() <= tolerance(engine.cfg, proposer.draft_model.cfg, want_states)
        margin = want_logits.topk(2, -1).values
        clear = (margin[:, 0] - margin[:, 1]) > 2 * tolerance(engine.cfg, proposer.draft_model.cfg, want_logits)
        assert all(d == w for d, w, c in zip(drafts, want_drafts, clear.tolist()) if c), (known, drafts, want_drafts)
        assert (confidence - want_confidence).abs().max() <= tolerance(engine.cfg, proposer.draft_model.cfg,
                                                                       want_states)


def test_a_generate_that_drafts_at_no_step_keeps_no_states_and_the_next_drafts_as_the_reference(prompts, reference):
    """A schedule of k = 0 at every batch size keeps no target states for a catch-up (none can come in that
    generate); the next generate, drafting at every step, drafts the blocks of vLLM's DSpark computation redone
    from scratch. Control: a schedule that drafts at one batch size keeps the states of its steps without drafts."""
    engine, proposer = recording_engine(4)
    engine.k_policy = ScheduleK([[1, 4, 0]], K, 4)
    engine.generate(samples_for_prompts(prompts[:4]), GREEDY)
    assert proposer.kept is None and not proposer.records
    engine.k_policy = FixedKAskingConfidences(K)
    engine.generate(samples_for_prompts(prompts[4:8]), GREEDY)
    assert len(proposer.records) >= 4
    assert_blocks_equal_the_reference(proposer, engine, reference)
    control, control_proposer = recording_engine(4)
    control.k_policy = ScheduleK([[1, 1, K], [2, 4, 0]], K, 4)
    control.generate(samples_for_prompts(prompts[:4]), GREEDY)
    assert control_proposer.kept is not None


@pytest.mark.parametrize("sizes", [False, True], ids=["policy-without-sizing", "control-sizing-policy"])
def test_the_confidence_head_runs_only_for_a_k_policy_that_sizes_steps_by_it(prompts, sizes):
    """A k policy that verifies every draft (fixed k) never runs the confidence head, and its greedy output is
    plain decoding's; the control, the same policy asking for the confidences, runs it at every drafting step."""
    engine, proposer = recording_engine(4)
    engine.k_policy = FixedKAskingConfidences(K) if sizes else FixedK(K)
    heads = []
    proposer.draft_model.confidence_head.register_forward_hook(lambda module, args, out: heads.append(out.shape))
    got = engine.generate(samples_for_prompts(prompts[:4]), GREEDY)
    plain = build_engine(TARGET, None, EngineConfig(max_batch_size=4)).generate(samples_for_prompts(prompts[:4]), GREEDY)
    assert [s.response_ids for s in got] == [s.response_ids for s in plain]
    assert len(proposer.records) > 0 and len(heads) == (proposer.drafting_steps if sizes else 0)
    assert all((c is None) != sizes for *_, c in proposer.records)


def test_blocks_drafts_and_confidences_equal_an_independent_reference_of_vllms_dspark(prompts, reference):
    """Every block the engine drafted (context written step by step and caught up after steps without
    drafts, ragged batches, moved slots) has the states, the greedy Markov drafts and the confidences of
    vLLM's DSpark computation redone from scratch on transformers' states."""
    engine, proposer = recording_engine(6)
    engine.k_policy = Alternating(K)
    engine.generate(samples_for_prompts(prompts[:10]), GREEDY)
    assert len(proposer.records) >= 2 * 10  # several blocks per request, across steps and slots
    assert_blocks_equal_the_reference(proposer, engine, reference)
    assert proposer.deferred_rows > 0  # some steps drafted nothing and their context was caught up later
    assert proposer.moved_deferred > 0  # some rows moved slots with context still to catch up


# ---------------------------------------------------------------- confidence-sized verification
def direct_sized_q(confidences, table):
    """The size by its definition: the first q where verifying one more draft does not raise (B + the rows'
    summed survival of drafts < q) / table[q], survival being the running product of the confidences."""
    b, k = confidences.shape
    survival = [[math.prod(row[:j + 1]) for j in range(k)] for row in confidences.tolist()]

    def rate(q):
        return (b + sum(sum(row[:q]) for row in survival)) / table[q]
    return next((q for q in range(k) if rate(q + 1) <= rate(q)), k)


@pytest.mark.parametrize("seed", range(20))
def test_sized_q_is_the_direct_formula_and_reads_no_confidence_past_the_draft_it_decides(seed):
    """sized_q against the direct formula on random confidences and price tables (several rows, every row the
    same q); and the exactness rule: confidences past q + 1 (those the drafts from q on decide) change nothing."""
    gen = torch.Generator().manual_seed(seed)
    rows, k = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
    confidences = torch.rand(rows, k, generator=gen) ** 0.3
    table = (1.0 + torch.rand(k + 1, generator=gen).cumsum(0) * float(torch.rand(1, generator=gen))).tolist()
    q = sized_q(confidences, table, k)
    want = direct_sized_q(confidences, table)
    assert q.tolist() == [want] * rows
    later = confidences.clone()
    later[:, want + 1:] = torch.rand(rows, max(k - want - 1, 0), generator=gen)
    assert sized_q(later, table, k).tolist() == [want] * rows


def test_sized_q_chooses_every_size_somewhere():
    """The direct formula's sizes on one price table: a confident row verifies all, an unsure one none, between
    them between (the formula is the size's definition, so the values come from it, not from here)."""
    table = [1.0, 1.3, 1.6, 1.9]
    sizes = {int(sized_q(torch.tensor([[c] * 3]), table, 3)[0]) for c in (0.1, 0.4, 0.5, 0.7, 0.99)}
    assert sizes == {direct_sized_q(torch.tensor([[c] * 3]), table) for c in (0.1, 0.4, 0.5, 0.7, 0.99)}
    assert len(sizes) >= 3


def test_the_unverified_drafts_count_in_the_acceptance_as_their_confidences_expect():
    """ConfidenceSizedK's step size is sized_q over the profile's prices at its batch size; the drafts it leaves
    unverified count as the confidences expect: rows reaching draft j (the summed survival of draft j - 1) and
    passing it (that of j); the verified ones are counted from the verify's outcome (not here)."""
    policy = ConfidenceSizedK(3)
    verify = {0: [1.0, 2.0], 1: [1.3, 2.8], 2: [1.6, 3.6], 3: [1.9, 4.4]}  # at 1 and 2 rows
    draft = {k: [0.0 if k == 0 else 0.4, 0.0 if k == 0 else 0.6] for k in range(4)}
    policy.set_costs([1, 2], verify, draft)
    seen = set()
    for confidences in ([[0.9, 0.9, 0.9]], [[0.5, 0.4, 0.5]], [[0.1, 0.0, 0.0]],
                        [[0.95, 0.95, 0.95], [0.4, 0.25, 0.0]]):
        c = torch.tensor(confidences)
        b = c.shape[0]
        want = direct_sized_q(c, [verify[q][b - 1] + draft[3][b - 1] for q in range(4)])
        before = list(policy.drafted), list(policy.accepted)
        assert policy.verification_size(b, c).tolist() == [want] * b
        seen.add(want)
        survival = c.cumprod(1)
        for j in range(3):
            reached = float(survival[:, j - 1].sum()) if j else float(b)
            assert policy.drafted[j] - before[0][j] == pytest.approx(reached if j >= want else 0.0)
            assert policy.accepted[j] - before[1][j] == pytest.approx(float(survival[:, j].sum()) if j >= want else 0.0)
    assert len(seen) >= 3


def test_a_batch_size_schedule_says_where_the_block_is_drafted_whatever_the_profile():
    """With num_speculative_tokens_per_batch_size beside enable_adaptive_verification the schedule's k is drafted
    (vLLM's dense lookup) and the profile only sizes the steps; the control, without a schedule, drafts where
    the profile prices the block faster (here everywhere: a verified draft is nearly free)."""
    config = parse_spec_config(spec(enable_adaptive_verification=True,
                                    num_speculative_tokens_per_batch_size=[[1, 2, 3], [3, 4, 0]]))
    for schedule, want in ((config.num_speculative_tokens_per_batch_size, [0, 3, 3, 0, 0]), (None, [0, 3, 3, 3, 3])):
        policy = ConfidenceSizedK(3, schedule, 4)
        policy.set_costs([1, 2, 4], {q: [1.0, 1.1, 1.2] for q in range(4)}, {k: [0.05 * (k > 0)] * 3 for k in range(4)})
        policy.begin()
        assert policy.lookup == want and [policy.choose(b) for b in range(1, 5)] == want[1:]


@pytest.mark.parametrize("emitted_share", [1.0, 0.6, 0.2], ids=["rows-run-on", "some-end-inside", "most-end-inside"])
def test_the_block_is_priced_at_the_share_of_its_accepted_drafts_its_steps_emitted(emitted_share):
    """Rows that end inside a block (a stop token before an accepted draft) emit fewer tokens than their drafts
    passed: the block is priced at 1 + (E(q) - 1) x the share of accepted drafts that drafting steps emitted
    (ACCEPT_PRIOR_ROWS drafts at 1), against plain decoding, DRAFT_MARGIN in plain's favour (the direct formula)."""
    grid = [1, 2, 4]
    verify = {q: [1.0 + 0.3 * q, 1.1 + 0.35 * q, 1.2 + 0.4 * q] for q in range(4)}
    draft = {k: [0.2 * (k > 0)] * 3 for k in range(4)}
    policy = ConfidenceSizedK(3)
    policy.set_costs(grid, verify, draft)
    policy.drafted, policy.accepted = [1e9] * 3, [0.9e9, 0.8e9, 0.7e9]  # acceptance given the drafts before
    for _ in range(10):  # drafting steps at 4 rows verifying 3 drafts: 9 accepted, emitted as the case says
        policy.observe(StepRecord(4, 3, 1.0, 3, 0.1, 4 + 9 * emitted_share, [4, 4, 3], [4, 3, 2]))
    share = (90 * emitted_share + ACCEPT_PRIOR_ROWS) / (90 + ACCEPT_PRIOR_ROWS)
    assert policy.realized() == pytest.approx(share)
    policy.begin()
    for b in (1, 2, 4):
        at = grid.index(b)
        block = (1 + (policy.tokens[3] - 1) * share) / (verify[3][at] + draft[3][at])
        assert policy.lookup[b] == (3 if block >= (1 + DRAFT_MARGIN) / verify[0][at] else 0)
    assert policy.lookup[1] == (3 if emitted_share > 0.5 else 0)  # the cases sit either side of the line at 1 row


def test_a_generate_that_starts_where_the_block_does_not_pay_decodes_plainly_to_its_end():
    """The profile prices the block faster than plain decoding at 1-2 rows only: a generate of 4 requests (starting
    at 4 rows) drafts at none of its steps, so its rows never catch up a draft context; one of 2 requests drafts
    where the profile says. Control: with a batch-size schedule the schedule decides, whatever the generate."""
    grid = [1, 2, 4]
    verify = {q: [1.0 + 0.1 * q, 1.1 + 0.2 * q, 1.2 + 2.0 * q] for q in range(4)}
    draft = {k: [0.1 * (k > 0)] * 3 for k in range(4)}
    for schedule, rows, want in ((None, 4, [0] * 5), (None, 2, [0, 3, 3, 0, 0]),
                                 ([[1, 4, 3]], 4, [0, 3, 3, 3, 3])):
        policy = ConfidenceSizedK(3, schedule, 4)
        policy.set_costs(grid, verify, draft)
        policy.begin()
        assert policy.drafts_this_generate(rows) == any(want)
        assert [policy.choose(b) for b in range(1, 5)] == want[1:]


def test_the_sized_schedule_prices_each_k_at_the_verification_its_steps_would_size_to():
    """Once steps are sized, the schedule's k at each batch size against the direct formula: the block
    (k = 3) where E(q) / (verify(B, 1+q) + draft(B, 3)) is at least (1 + DRAFT_MARGIN) a plain step's 1 / verify(B, 1), q
    being where one more verified draft stops raising that rate at the measured acceptance, else 0.
    Control: on the same profile AdaptiveK, which verifies all it drafts, drafts fewer than the block
    where a whole verify does not pay, so its steps could never verify more."""
    grid = [1, 2, 4]
    verify = {0: [1.0, 1.5, 2.0], 1: [1.1, 1.8, 2.8], 2: [1.2, 2.6, 4.6], 3: [2.6, 3.6, 6.6]}
    draft = {k: [0.0 if k == 0 else 0.3, 0.0 if k == 0 else 0.4, 0.0 if k == 0 else 0.6] for k in range(4)}
    seen = set()
    for accept in ([0.9, 0.7, 0.6], [0.5, 0.32, 0.2], [0.1, 0.05, 0.0], [0.95, 0.95, 0.95]):
        policy, adaptive = ConfidenceSizedK(3), AdaptiveK(3)
        policy.set_costs(grid, verify, draft)
        adaptive.set_profile(grid, {k: [v + d for v, d in zip(verify[k], draft[k])] for k in verify})
        policy.verification_size(1, torch.ones(1, 3))  # a sized step: the block priced as sized from here on
        for p in (policy, adaptive):
            p.corrects_costs = False
            # rows reaching draft j and accepting it: a_j, its acceptance given the drafts before it
            p.drafted, p.accepted = [1e9] * 3, [1e9 * a for a in accept]
            p.begin()
        tokens = [1 + sum(math.prod(accept[:i + 1]) for i in range(q)) for q in range(4)]
        for b in (1, 2, 4):
            at = grid.index(b)

            def rate(q, k):
                return tokens[q] / (verify[q][at] + draft[k][at])

            def sized_q(k):
                return next((q for q in range(k) if rate(q + 1, k) <= rate(q, k)), k)

            want = 3 if rate(sized_q(3), 3) >= (1 + DRAFT_MARGIN) * rate(0, 0) else 0
            assert policy.lookup[b] == want, (accept, b)
            seen.add(want)
    assert seen == {0, 3}  # both choices made somewhere
    assert (policy.lookup[1], adaptive.lookup[1]) == (3, 2)  # the control, on the last case


# ---------------------------------------------------------------- training
@pytest.mark.parametrize("gamma, decay", [(1.7, 1.7), (None, 2.0)], ids=["given", "default"])
def test_the_loss_is_the_recipes_three_terms_by_direct_formula(gamma, decay):
    """dspark_loss against the terms written out: CE on the next token, L1 to softmax(policy / T),
    BCE of the confidence against 1 - L1/2, slot i weighted exp(-i/gamma), over the response slots.
    The default decay is that of a DFlash block drafting the same 3 tokens: 4 slots, gamma = 4 / 2."""
    torch.manual_seed(0)
    target_cfg = dataclasses.replace(read_config(TARGET), vocab_size=11, pad_token_id=0)
    draft = DSparkDraft(draft_config_for_target(target_cfg, 1, 3, markov_rank=4, confidence_head_with_markov=True))
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.3)
    b, t, h, v = 2, 9, target_cfg.hidden_size, 11
    aux, tokens = torch.randn(b, t, 3 * h), torch.randint(1, v, (b, t))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1, 1, 1]]).float()
    embed, head, policy = torch.randn(v, h) * 0.3, torch.randn(v, h) * 0.3, torch.randn(b, t, v)
    weights, temperature = {"ce": 0.3, "l1": 0.5, "confidence": 0.7}, 0.8
    gen = torch.Generator().manual_seed(3)
    loss, per_slot, parts = dspark_loss(draft, aux, tokens, mask, embed, head, 2, policy, weights, gamma, gen,
                                        temperature)
    from mtp.dflash import sample_anchors
    anchors, keep = sample_anchors(mask, 2, torch.Generator().manual_seed(3))
    states, positions = block_states(draft, aux, tokens, anchors, keep, embed)
    total = norm = 0.0
    for row in range(b):
        for j, a in enumerate(anchors[row].tolist()):
            for i in range(3):
                p = a + i
                if not keep[row, j] or p + 1 >= t or mask[row, p + 1] == 0:
                    continue
                e = draft.markov_head.markov_w1.weight[tokens[row, p]]
                z = states[row, j * 3 + i] @ head.T + draft.markov_head.markov_w2.weight @ e
                ce = -torch.log_softmax(z, -1)[tokens[row, p + 1]]
                l1 = (torch.softmax(z / temperature, -1) - torch.softmax(policy[row, p] / temperature, -1)).abs().sum()
                c = torch.cat([states[row, j * 3 + i], e]) @ draft.confidence_head.proj.weight[0] + \
                    draft.confidence_head.proj.bias[0]
                label = 1 - l1 / 2
                bce = -(label * F.logsigmoid(c) + (1 - label) * F.logsigmoid(-c))
                w = torch.exp(torch.tensor(-i / decay))
                total = total + w * (0.3 * ce + 0.5 * l1 + 0.7 * bce)
                norm = norm + w
    want = total / norm
    loss, want = float(loss.detach()), float(want.detach())
    assert abs(loss - want) <= reduction_rtol(v * h, 4) * max(1.0, want)
    assert per_slot.shape == (3,) and set(parts) == {"ce", "l1", "confidence"}


# ---------------------------------------------------------------- sampled output: the target distribution
N, ALPHA = 20000, 1e-3  # samples after spec_fixtures.sampled_counts' prompt


@pytest.fixture(scope="module")
def vocab_pair():
    """The kinds' 5-token target (draft_kind_fixtures) and a random DSpark draft on it (blocks of 2) whose
    confidence head leans on the Markov embedding, so that slot 1's confidence depends on the token drawn
    at slot 0."""
    from draft_kind_fixtures import SMALL_TARGET_LAYERS, random_draft, vocab_pair as kinds_pair

    target, _ = kinds_pair(DSPARK)
    cfg = draft_config_for_target(target.cfg, 1, 2, markov_rank=3, confidence_head_with_markov=True,
                                  target_layer_ids=SMALL_TARGET_LAYERS["dspark"])
    draft = random_draft(DSPARK, target.cfg, seed=4, std=0.35, cfg=cfg)
    with torch.no_grad():
        draft.confidence_head.proj.weight[:, target.cfg.hidden_size:].mul_(10)
    return target, draft


def proposer(draft, method, sample_drafts):
    sc = parse_spec_config(spec(2, model="unused", rejection_sample_method=method))
    return DSparkProposer(sc, draft=draft, sample_drafts=sample_drafts)


class RowsStopWhereSurvivalFalls(FixedKAskingConfidences):
    """Each row verifies its drafts while their survival stays >= 1/2: whether draft j is verified
    depends on the confidences up to j, which the drafts before j decide (ConfidenceSizedK's rule, per row)."""

    def verification_size(self, batch_size, confidences):
        return (confidences.cumprod(1) >= 0.5).sum(1)


class RowsPeekAtTheNextSurvival(FixedKAskingConfidences):
    """The negative control: a row verifies both drafts when the survival of slot 1 is >= 0.04, else none;
    that survival depends on the token drawn at slot 0, so slot 0's draft is verified according to its
    own value."""

    def verification_size(self, batch_size, confidences):
        return torch.where(confidences.cumprod(1)[:, 1] >= 0.04, 2, 0)


def test_sampled_output_sized_by_each_rows_confidence_follows_the_target_distribution(vocab_pair):
    """Sampled drafts drawn left to right through the Markov head, verified with their q, each row verifying
    the drafts its survival admits (decided by the drafts before them)."""
    target, draft = vocab_pair
    check_sampled_drafts_keep_the_target_distribution(target, proposer(draft, "probabilistic", True), "probabilistic",
                                                      N, ALPHA, RowsStopWhereSurvivalFalls(2))


@pytest.mark.slow
def test_the_distribution_test_rejects_verification_sized_by_the_drafts_own_values(vocab_pair):
    """Why the sizing stops where survival falls: a size that peeks at the confidence a draft itself
    decides verifies that draft as if drawn from another distribution, and the test catches it."""
    from spec_fixtures import chi_square_p_value, exact_joint, sampled_counts

    target, draft = vocab_pair
    counts, _ = sampled_counts(target, proposer(draft, "probabilistic", True), "probabilistic", N,
                               k_policy=RowsPeekAtTheNextSurvival(2))
    assert chi_square_p_value(counts, exact_joint(target), N) < ALPHA


# ---------------------------------------------------------------- the format, and bad drafts: one line each
def test_the_shipped_draft_is_in_vllms_format():
    with open(os.path.join(DRAFT, "config.json")) as f:
        raw = json.load(f)
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["model_type"] == "qwen3"
    assert raw["target_layer_ids"] == [1, 3, 5] and raw["block_size"] == K and raw["sample_from_anchor"] is True
    assert raw["dspark_noise_token_id"] == read_config(TARGET).pad_token_id
    assert raw["markov_rank"] >= 1 and raw["enable_confidence_head"] is True


def copy_draft(tmp_path, edit_config=None):
    out = tmp_path / "draft"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(DRAFT, out)
    if edit_config:
        raw = json.loads((out / "config.json").read_text())
        edit_config(raw)
        (out / "config.json").write_text(json.dumps(raw))
    return str(out)


def refusal(target, draft_dir, k=K, **extra):
    with pytest.raises(UserError) as e:
        check_against_checkpoint(parse_spec_config(spec(k, model=draft_dir, **extra)), read_config(target))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_draft_whose_heads_or_block_do_not_fit_is_refused(tmp_path):
    assert "lacks 'markov_rank'" in refusal(TARGET, copy_draft(tmp_path, lambda raw: raw.pop("markov_rank")))
    assert "dspark_noise_token_id is the integer 32" in refusal(TARGET, copy_draft(tmp_path, lambda raw: raw.update(
        dspark_noise_token_id=32)))
    assert "markov_rank" in refusal(TARGET, copy_draft(tmp_path, lambda raw: raw.update(markov_rank=5)))
    assert "confidence_head.proj" in refusal(TARGET, copy_draft(tmp_path, lambda raw: raw.update(
        enable_confidence_head=False)))
    assert "sample_from_anchor" in refusal(TARGET, copy_draft(tmp_path, lambda raw: raw.update(sample_from_anchor=False)))
    message = refusal(TARGET, DRAFT, k=K + 1)
    assert f"num_speculative_tokens {K + 1}" in message and f"blocks of {K}" in message


def test_adaptive_verification_without_a_confidence_method_is_refused():
    with pytest.raises(UserError, match="enable_adaptive_verification sizes verification by the draft's confidence"):
        parse_spec_config({"method": "dflash", "model": DRAFT, "num_speculative_tokens": 3,
                           "enable_adaptive_verification": True})
    with pytest.raises(UserError, match="enable_adaptive_verification must be true or false"):
        parse_spec_config(spec(enable_adaptive_verification="yes"))


def test_make_dspark_draft_refuses_bad_options_in_one_line(tmp_path, capsys):
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from make_dspark_draft import main

    for flag, value, message in (("--block-size", "0", "error: --block-size must be >= 1"),
                                 ("--markov-rank", "0", "error: --markov-rank must be >= 1"),
                                 ("--l1-weight", "-1", "error: --l1-weight must be >= 0")):
        with pytest.raises(SystemExit) as e:
            main(["--target", TARGET, "--out", str(tmp_path / "d"), flag, value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.strip().count("\n") == 0 and err.startswith(message), err
