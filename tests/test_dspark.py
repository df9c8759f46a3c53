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
from rollout.embedded.spec_policy import (COST_KEEP_PER_GENERATE, DRAFT_MARGIN, PAIR_FORGET, PAIR_KEEP_PER_GENERATE,
                                          PAIR_LOSING_EXTRA_MAX, PAIR_MIN_STEPS, PAIR_RUN_STEPS, PAIR_STALE,
                                          RATE_KEEP_GENERATES, RATE_KEEP_MAX_GENERATES, RATE_STEPS, RETRY_SHARE,
                                          AdaptiveK, ConfidenceSizedK, FixedK, ScheduleK, StepRecord)
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
        self.deferred_positions += sum(start - self.written[s] for s, start in zip(slots, starts))
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
    proposer.records, proposer.deferred_rows, proposer.moved_deferred, proposer.deferred_positions = [], 0, 0, 0
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
    # what the k policy is told a switch to drafting caught up (no policy here took it): every deferred position
    positions, seconds = proposer.take_catch_up()
    assert positions == proposer.deferred_positions and seconds > 0 and proposer.take_catch_up() == (0, 0.0)


# ---------------------------------------------------------------- confidence-sized verification
def test_the_verification_size_verifies_while_one_more_draft_raises_the_expected_rate():
    """ConfidenceSizedK's q against the direct formula: q grows while rate(q + 1) > rate(q), rate(q) =
    (B + the rows' summed survival of drafts < q) / (verify(B, 1+q) + draft(B, k)), on a profile where
    several q are chosen."""
    policy = ConfidenceSizedK(3)
    verify = {0: [1.0, 2.0], 1: [1.3, 2.8], 2: [1.6, 3.6], 3: [1.9, 4.4]}  # at 1 and 2 rows
    draft = {k: [0.0 if k == 0 else 0.4, 0.0 if k == 0 else 0.6] for k in range(4)}
    policy.set_costs([1, 2], verify, draft)
    seen = set()
    for survival in ([[0.9, 0.8, 0.7]], [[0.5, 0.2, 0.1]], [[0.1, 0.0, 0.0]], [[0.95, 0.9, 0.85], [0.4, 0.1, 0.0]],
                     [[0.99, 0.98, 0.97], [0.99, 0.98, 0.97]]):
        s = torch.tensor(survival)
        b = s.shape[0]
        def rate(q):
            return (b + float(s[:, :q].sum())) / (verify[q][b - 1] + draft[3][b - 1])
        want = next((q for q in range(3) if rate(q + 1) <= rate(q)), 3)
        before = list(policy.drafted), list(policy.accepted)
        assert policy.verification_size(b, s) == want
        seen.add(want)
        # the drafts left unverified count as the confidence expects: rows reaching j (survival of j - 1)
        # and passing it (survival of j); the verified ones are counted from the verify's outcome
        for j in range(3):
            reached = float(s[:, j - 1].sum()) if j else float(b)
            assert policy.drafted[j] - before[0][j] == pytest.approx(reached if j >= want else 0.0)
            assert policy.accepted[j] - before[1][j] == pytest.approx(float(s[:, j].sum()) if j >= want else 0.0)
    assert len(seen) >= 3


def flat_sized_policy(draft_s=0.1):
    """A sized schedule at 1 and 2 rows on a flat profile (a verify 1.0 s at 1 row and 1.1 s at 2, whatever it
    verifies; a drafting draft_s), after one sized step and the first generate's begin."""
    policy = ConfidenceSizedK(3)
    policy.set_costs([1, 2], {q: [1.0, 1.1] for q in range(4)}, {k: [draft_s * (k > 0)] * 2 for k in range(4)})
    policy.verification_size(2, torch.ones(2, 3))  # a sized step: the sized schedule from here on
    policy.begin()
    return policy


def sized_step(b, q, k, verify_s, draft_s, emitted=None):
    """A StepRecord of b rows verifying q of k drafts, emitting `emitted` tokens (default one a row;
    acceptance counts beside the point here)."""
    return StepRecord(b, q, verify_s, k, draft_s, b if emitted is None else emitted, [0] * k, [0] * k)


def test_a_sized_step_is_priced_at_the_profile_plus_the_extra_seconds_real_steps_took_near_its_batch_size():
    """The price of a step against the direct formula: the profile's verify(b, 1+q) and draft(b, k), plus the
    mean extra seconds that real steps' verify (with drafts, or without: a plain step) and drafting took
    at the profile's grid point nearest b, pooled over every q and k: a q never run is priced with the
    others' extra; a bucket without evidence takes the nearest bucket's; a plain verify never run takes
    the drafting verifies' extra per token they emitted, for its b tokens; every extra decays at each
    generate (COST_KEEP_PER_GENERATE), which leaves a mean unchanged."""
    grid = [1, 2, 4, 8]
    verify = {q: [1.0 + 0.1 * q * b for b in grid] for q in range(4)}
    draft = {k: [(0.3 + 0.05 * b) * (k > 0) for b in grid] for k in range(4)}
    policy = ConfidenceSizedK(3)
    policy.set_costs(grid, verify, draft)
    at = {b: grid.index(b) for b in grid}
    extra_verify, extra_draft = [0.5, 0.7, 0.3], [0.2, 0.4, 0.0]  # the real steps' seconds beyond the profile at 2 rows
    emitted = [7, 5, 8]  # tokens each of those steps emitted (2 rows, up to 4 tokens a row)
    for ev, ed, n in zip(extra_verify, extra_draft, emitted):
        policy.observe(sized_step(2, 3, 3, verify[3][at[2]] + ev, draft[3][at[2]] + ed, n))
    policy.begin()
    mean_verify, mean_draft = sum(extra_verify) / 3, sum(extra_draft) / 3
    per_token = sum(extra_verify) / sum(emitted)
    for b in (1, 2, 3, 4, 8):  # 1 and 3 are nearest to 2 (4 too: nearest with evidence); 8 too
        assert policy.step_offsets[b] == pytest.approx((per_token * b, mean_verify, mean_draft, 0.0))
    for q in range(1, 4):  # q = 1, 2 never ran: priced with q = 3's extra
        assert policy.price(2, q, 3, policy.step_offsets[2]) == pytest.approx(
            verify[q][at[2]] + mean_verify + draft[3][at[2]] + mean_draft)
    assert policy.price(2, 0, 3, policy.step_offsets[2]) == pytest.approx(
        verify[0][at[2]] + 2 * per_token + draft[3][at[2]] + mean_draft)
    assert policy.price(2, 0, 0, policy.step_offsets[2]) == pytest.approx(verify[0][at[2]] + 2 * per_token)
    # plain steps at 8 rows: their own extra there (and at 4, nearer to 8 than 2 is), the verify's elsewhere
    policy.observe(sized_step(8, 0, 0, verify[0][at[8]] - 0.1, 0.05))
    policy.begin()
    assert policy.step_offsets[8] == pytest.approx((-0.1, mean_verify, mean_draft, 0.05))
    assert policy.step_offsets[2] == pytest.approx((-0.1, mean_verify, mean_draft, 0.05))  # 2's bucket has no plain step
    assert policy.evidence["verify"].steps[at[2]] == pytest.approx(3 * COST_KEEP_PER_GENERATE ** 2)


def test_host_work_added_to_every_verify_sizes_steps_as_their_true_costs_do():
    """Real verifies cost the profile plus the same host work h for any q (what the engine's acceptance and
    bookkeeping add around a forward). After such steps, the verification size equals the direct
    formula's argmax on the true costs, for survivals where several q win. Control: the same evidence
    read as one factor on the whole verify (real over profiled seconds) prices each more verified draft
    that factor too dear and sizes some of those steps shorter."""
    grid = [1, 2]
    verify = {q: [1.0 + 0.25 * q, 1.2 + 0.3 * q] for q in range(4)}
    draft = {k: [0.4 * (k > 0), 0.5 * (k > 0)] for k in range(4)}
    h = 1.0  # host work per verify, as much as a forward at 1 row
    policy = ConfidenceSizedK(3)
    policy.set_costs(grid, verify, draft)
    for q in (3, 3, 2, 0):
        policy.observe(sized_step(2, q, 3 if q else 0, verify[q][1] + h, draft[3][1] if q else 0.0))
    policy.begin()
    factor = sum(verify[q][1] + h for q in (3, 3, 2, 0)) / sum(verify[q][1] for q in (3, 3, 2, 0))
    differs = 0
    for survival in ([[0.9, 0.5, 0.2], [0.8, 0.4, 0.1]], [[0.6, 0.3, 0.1], [0.5, 0.2, 0.05]],
                     [[0.95, 0.9, 0.8], [0.9, 0.85, 0.7]], [[0.3, 0.1, 0.0], [0.2, 0.0, 0.0]]):
        s = torch.tensor(survival)

        def rate(q, scale=1.0, add=h):
            return (2 + float(s[:, :q].sum())) / (scale * verify[q][1] + add + draft[3][1])

        def argmax_q(**price):
            return next((q for q in range(3) if rate(q + 1, **price) <= rate(q, **price)), 3)
        assert policy.verification_size(2, s) == argmax_q()
        differs += argmax_q() != argmax_q(scale=factor, add=0.0)
    assert differs >= 1  # the control: a factor on the whole verify would have sized differently


def test_measured_rates_of_plain_and_block_steps_decide_where_both_ran():
    """At a batch size where the profile says the block pays, the sized schedule drafts it until
    RATE_STEPS steps of plain decoding and of the block are both measured there; from then the measured
    tokens per second decide (the direct formula: a verify's mean tokens over a verify's and a
    drafting's mean seconds), the block only where it ran DRAFT_MARGIN faster. Cases: plain faster
    (the profile overruled), the block faster by more than the margin, the block faster by less."""
    grid = [1, 2]
    verify = {q: [1.0, 1.1] for q in range(4)}  # a flat verify and a cheap draft: the profile says draft
    draft = {k: [0.1 * (k > 0), 0.1 * (k > 0)] for k in range(4)}
    n, wants = int(RATE_STEPS), []
    # (plain verify s, plain tokens, block verify s, block draft s, block tokens) per step, and the choice
    for plain_s, plain_tokens, block_s, block_draft_s, block_tokens in ((0.5, 2, 1.0, 0.5, 4), (1.0, 2, 1.0, 0.2, 4),
                                                                         (1.0, 2, 1.0, 0.95, 4)):
        policy = ConfidenceSizedK(3)
        policy.set_costs(grid, verify, draft)
        policy.verification_size(2, torch.ones(2, 3))  # a sized step: the sized schedule from here on
        policy.begin()
        assert policy.lookup[2] == 3
        for _ in range(n - 1):  # one step short of deciding
            policy.observe(sized_step(2, 3, 3, block_s, block_draft_s, block_tokens))
            policy.observe(sized_step(2, 0, 0, plain_s, 0.0, plain_tokens))
        policy.begin()
        assert policy.lookup[2] == 3
        for _ in range(n):
            policy.observe(sized_step(2, 3, 3, block_s, block_draft_s, block_tokens))
            policy.observe(sized_step(2, 0, 0, plain_s, 0.0, plain_tokens))
        block_rate = block_tokens / (block_s + block_draft_s)
        want = 3 if block_rate >= (1 + DRAFT_MARGIN) * plain_tokens / plain_s else 0
        policy.begin()
        assert policy.lookup[2] == want
        wants.append(want)
    assert wants == [0, 3, 0]  # plain faster; the block faster by more than the margin; by less


@pytest.mark.parametrize("draft_s", [0.1, 4.0], ids=["price-drafts", "price-does-not"])
def test_where_only_one_option_was_measured_the_other_runs_to_compare(draft_s):
    """Where only steps of the option the price chooses were rated (from the second generate on), the next
    generate runs the other option there; once both are rated, the measured rates decide (the direct
    formula; here the block, measured faster, in both cases)."""
    n = int(RATE_STEPS)
    policy = flat_sized_policy(draft_s)
    priced = policy.lookup[2]
    assert priced == (3 if draft_s < 1 else 0)
    block, plain = sized_step(2, 3, 3, 0.2, 0.1, 8), sized_step(2, 0, 0, 0.2, 0.0, 2)
    for generate in range(2):  # the first generate's steps are not rated: the price still decides after it
        assert policy.lookup[2] == priced
        for _ in range(2 * n):
            policy.observe(block if priced else plain)
        policy.begin()
    assert policy.lookup[2] == 3 - priced and policy.lookup[1] == priced  # the other tried where one ran
    for _ in range(n):
        policy.observe(plain if priced else block)
    policy.begin()
    assert policy.lookup[2] == (3 if 8 / 0.3 >= (1 + DRAFT_MARGIN) * 2 / 0.2 else 0) == 3


@pytest.mark.parametrize("stepped", [True, False], ids=["tried-unrated", "control-not-stepped"])
def test_an_option_that_ran_without_a_rated_step_where_the_other_is_measured_is_not_tried_again(stepped):
    """Where only plain decoding is measured at a bucket, the next generate tries the block there; if that
    generate stepped there and no block step was rated (here its one step verified nothing: the drafts it made
    would be verified at the next bucket), the measured option decides for the block's retry wait there
    (RATE_KEEP_GENERATES generates), and the block is tried again after it. The control: the generate that would
    try the block never stepped at that bucket, and the block is tried at the next."""
    n = int(RATE_STEPS)
    policy = flat_sized_policy(4.0)
    policy.begin()  # the first generate's steps are not rated
    assert policy.lookup[2] == 0  # the price: plain decoding
    for _ in range(n):
        policy.observe(sized_step(2, 0, 0, 0.4, 0.0, 2))
    policy.begin()
    assert policy.lookup[2] == 3  # only plain decoding measured: the block is tried
    if stepped:
        policy.observe(StepRecord(2, 0, 0.4, 3, 0.3, 2, [0] * 3, [0] * 3))
    policy.begin()
    assert policy.rates["block"].rate(policy.bucket_of[2], 1.0) is None
    assert policy.lookup[2] == (0 if stepped else 3)
    if stepped:  # not at every other generate either: plain decoding for the wait, then the block again
        ks = []
        for _ in range(RATE_KEEP_GENERATES):
            for _ in range(n):
                policy.observe(sized_step(2, 0, 0, 0.4, 0.0, 2))
            policy.begin()
            ks.append(policy.lookup[2])
        assert ks == [0] * (RATE_KEEP_GENERATES - 1) + [3]


def test_the_proposers_work_after_a_prefill_counts_in_the_drafting_seconds_of_the_option_chosen_then():
    """A prefill's proposer seconds P join the drafting seconds of the option chosen at its batch size,
    at no step of their own: the block's rate at 2 rows after n steps of verify v, drafting d, t tokens
    is t / (v + (n d + P) / n) (the direct formula); the first generate's are not rated; with k = 0 they
    go to plain decoding's drafting seconds."""
    grid, n, v, d, t, prefill = [1, 2], int(RATE_STEPS), 0.2, 0.1, 8, 0.6
    policy = ConfidenceSizedK(3)
    policy.set_costs(grid, {q: [1.0, 1.1] for q in range(4)}, {k: [0.1 * (k > 0)] * 2 for k in range(4)})
    policy.begin()
    policy.observe_prefill(2, 3, 100.0)  # the first generate: not rated
    policy.begin()
    policy.observe_prefill(2, 3, prefill)
    policy.observe_prefill(2, 0, prefill)
    for _ in range(n):
        policy.observe(sized_step(2, 3, 3, v, d, t))
        policy.observe(sized_step(2, 0, 0, v, 0.0, 2))
    at = policy.bucket_of[2]
    assert policy.rates["block"].rate(at) == pytest.approx(t / (v + (n * d + prefill) / n))
    assert policy.rates["plain"].rate(at) == pytest.approx(2 / (v + prefill / n))


def test_an_option_no_longer_run_keeps_its_last_measured_rate_the_blocks_scaled_by_its_expected_tokens(monkeypatch):
    """Once plain and block steps were both measured at a batch size (from the second generate on: the
    first one's steps are not rated), the option ruled out stops running there and its rate expires; the
    choice then compares the other's rate with its last one for RATE_KEEP_GENERATES generates, where the
    profile's price alone would choose otherwise, and tries the ruled-out option again after. The block's last
    rate counts scaled by its expected tokens 1 + a + a^2 + a^3 now over then (a: the acceptance): the
    direct formula decides when the acceptance moves. Both ways: plain measured faster where the price
    drafts, and the block measured faster where it does not (then the block's own new steps decide
    against plain's last rate)."""
    def tokens(a):
        return 1 + a + a * a + a ** 3

    # these generates feed both options' steps at one bucket: no comparison inside a generate (paired evidence)
    monkeypatch.setattr("rollout.embedded.spec_policy.PAIR_MIN_STEPS", math.inf)
    grid, n = [1, 2], int(RATE_STEPS)
    verify = {q: [1.0, 1.1] for q in range(4)}
    for draft_s, plain_s, block_s, start in ((0.1, 0.2, 1.0, 0.5), (4.0, 1.0, 0.2, 0.9)):
        draft = {k: [draft_s * (k > 0)] * 2 for k in range(4)}
        policy = ConfidenceSizedK(3)
        policy.set_costs(grid, verify, draft)
        policy.verification_size(2, torch.ones(2, 3))  # a sized step: the sized schedule from here on
        policy.drafted, policy.accepted = [1e9] * 3, [1e9 * start] * 3
        policy.begin()
        priced = policy.lookup[2]
        for first in (True, False):
            for _ in range(n):
                policy.observe(sized_step(2, 3, 3, block_s, 0.1, 8))
                policy.observe(sized_step(2, 0, 0, plain_s, 0.0, 2))
            if first:  # the first generate's steps are not rated
                assert policy.rates["block"].rate(policy.bucket_of[2]) is None
            policy.begin()
        block_rate, plain_rate = 8 / (block_s + 0.1), 2 / plain_s
        measured = policy.lookup[2]
        assert measured == (3 if block_rate >= (1 + DRAFT_MARGIN) * plain_rate else 0) != priced
        for _ in range(3):  # only the chosen option runs: the other's rate expires
            policy.observe(sized_step(2, 3, 3, block_s, 0.1, 8) if measured else sized_step(2, 0, 0, plain_s, 0.0, 2))
            policy.begin()
            assert policy.lookup[2] == measured
        assert policy.rates["plain" if measured else "block"].rate(policy.bucket_of[2]) is None
        if measured:  # the block's own steps slow down 100x: mixed with the fewer fast ones before, their
            for _ in range(4 * n):  # rate is below 8 / (100 block_s * 4n / (5n + 3)), under plain's last rate
                policy.observe(sized_step(2, 3, 3, 100 * block_s, 0.1, 8))
            policy.begin()
            assert 8 / (100 * block_s * 4 * n / (5 * n + 3)) < plain_rate and policy.lookup[2] == 0
            continue
        choices = []
        for a in (0.6, 0.9):  # the acceptance grows: the block's last rate scaled by its tokens
            policy.accepted = [1e9 * a] * 3
            policy.begin()
            scaled = block_rate * tokens(a) / tokens(start)
            choices.append(policy.lookup[2])
            assert policy.lookup[2] == (3 if scaled >= (1 + DRAFT_MARGIN) * plain_rate else 0), a
        assert choices == [0, 3]  # 0.9 tips it, 0.6 does not
        # back where it was: plain, until the block's last rate is RATE_KEEP_GENERATES generates old; the block
        # tried again after (generates since its rate was last measured: the 3 above, the 2 of the acceptance and
        # this one; the generate the 0.9 wrote ran no step, so it tried nothing)
        policy.accepted = [1e9 * start] * 3
        policy.begin()
        assert policy.lookup[2] == 0
        for since in range(7, RATE_KEEP_GENERATES + 1):
            for _ in range(n):  # a bucket that runs RATE_STEPS steps a generate: drained ones are tested apart
                policy.observe(sized_step(2, 0, 0, plain_s, 0.0, 2))
            policy.begin()
            assert policy.lookup[2] == (0 if since < RATE_KEEP_GENERATES else 3), since


@pytest.mark.parametrize("slow_verify_s", [0.6, 0.764, 1.3], ids=["level", "loses-a-fifth", "loses-most"])
def test_a_retry_that_rules_the_block_out_again_waits_double_or_its_losss_share_whichever_is_longer(slow_verify_s):
    """Where the block's measured rate loses to plain decoding's, the block is retried once its last rate is
    RATE_KEEP_GENERATES generates old; each retry that rules it out again waits twice as long, or as long as makes
    its loss (plain decoding's rate over the block's, less 1) RETRY_SHARE of the generates waited, whichever is
    longer, up to RATE_KEEP_MAX_GENERATES (a drafting generate follows the last one after a wait + 1); the waits
    against that direct formula, for a block level with plain decoding (not the margin faster), one losing a fifth
    and one losing most. The control: a retry the block wins resets the wait, and the next time it is ruled out it
    is retried after RATE_KEEP_GENERATES + 1."""
    policy = flat_sized_policy()
    slow, fast = sized_step(2, 3, 3, slow_verify_s, 0.2, 4), sized_step(2, 3, 3, 0.1, 0.1, 8)  # fast: 40 tokens/s
    plain = sized_step(2, 0, 0, 0.4, 0.0, 2)  # 5 tokens/s
    loss = (2 / 0.4) / (4 / (slow_verify_s + 0.2)) - 1
    wins_at = 6  # the block's drafting generate (counted from 0) that runs fast
    drafted = []
    for generate in range(230):
        if policy.lookup[2]:
            step = fast if len(drafted) == wins_at else slow
            drafted.append(generate)
        else:
            step = plain
        for _ in range(int(RATE_STEPS)):
            policy.observe(step)
        policy.begin()
    waits = [b - a - 1 for a, b in zip(drafted, drafted[1:])]

    def retry_waits(n):  # the first ruling-out waits RATE_KEEP_GENERATES, each retry after it the longer rule
        out = [RATE_KEEP_GENERATES]
        while len(out) < n:
            out.append(min(max(2 * out[-1], math.ceil(loss / RETRY_SHARE)), RATE_KEEP_MAX_GENERATES))
        return out
    # the first generate's steps are not rated, so the block runs again at the second
    assert waits[:7] == [0] + retry_waits(5) + [0]
    # the fast steps count in the block's rate a few generates more, then the first ruling-out waits as at first
    assert [w for w in waits[7:] if w][:2] == retry_waits(2)
    assert len(set(waits)) == (4 if slow_verify_s < 1 else 3)  # the three cases take different ways


def run_sized_generate(policy, steps, block_step, plain_step):
    """One generate at 2 rows: `steps` steps, each drafting what the policy chooses and observed as the block's
    step or plain decoding's; then the next generate begins. Returns the ks chosen."""
    ks = []
    for _ in range(steps):
        ks.append(policy.choose(2))
        policy.observe(block_step if ks[-1] else plain_step)
    policy.begin()
    return ks


@pytest.mark.parametrize("block_s", [0.2, 2.0, 2.5, 5.0], ids=["block-faster", "plain-faster-by-a-twentieth",
                                                                "plain-faster-by-a-third", "block-loses-most"])
def test_a_bucket_compares_the_block_and_plain_decoding_inside_one_generate_and_their_ratio_decides(block_s):
    """Where a generate ran PAIR_MIN_STEPS steps at a batch bucket and no paired evidence is there, the next
    generate runs PAIR_RUN_STEPS steps of plain decoding there, then the block to the bucket's end; the ratio of
    their rates in that generate (the direct formula: tokens over a verify's and a drafting's mean seconds,
    each) decides from then on, the block where it is DRAFT_MARGIN faster, also against the rates of other
    generates: the control is a generate drafting the block on a machine 10x slower, where the ratio of
    rates measured in different generates (measured_choice) chooses plain decoding. The comparison repeats at
    the first generate where its evidence (1 per comparison, times PAIR_KEEP_PER_GENERATE per generate since)
    falls under a threshold: PAIR_STALE; where the block loses a share L of plain decoding's time, PAIR_STALE
    times PAIR_KEEP_PER_GENERATE ** e, e the generates beyond PAIR_STALE's 10 that make L a RETRY_SHARE of the
    generates between comparisons (at most 10, so that the evidence still decides when the comparison runs)."""
    policy = flat_sized_policy()
    block, plain = sized_step(2, 3, 3, block_s, 0.1, 8), sized_step(2, 0, 0, 0.5, 0.0, 2)
    compared = [0] * PAIR_RUN_STEPS + [3] * (2 * PAIR_MIN_STEPS - PAIR_RUN_STEPS)  # plain first, then the block
    comparisons, generate = [], 0  # the generates that compared

    def run(steps, step=block):
        nonlocal generate
        generate += 1
        ks = run_sized_generate(policy, steps, step, plain)
        if len(set(ks)) > 1:
            assert ks == compared[:steps]
            comparisons.append(generate)
        return ks

    assert run(PAIR_MIN_STEPS) == [3] * PAIR_MIN_STEPS  # the price drafts
    scheduled = policy.lookup[2]  # what the comparing generate's schedule drafts (from the price, its offsets)
    run(2 * PAIR_MIN_STEPS)
    assert comparisons == [2]
    ratio = (8 / (block_s + 0.1)) / (2 / 0.5)
    want = 3 if ratio >= 1 + DRAFT_MARGIN else 0
    assert policy.lookup[2] == want
    if want:  # the control: the block's steps on a slower machine, against plain decoding's last rate
        slow = sized_step(2, 3, 3, 10 * block_s, 1.0, 8)
        assert run(PAIR_MIN_STEPS, slow) == [3] * PAIR_MIN_STEPS
        assert policy.measured_choice(2) == 0 and policy.lookup[2] == 3
    elif scheduled:  # the verdict differs from the schedule that drafted: compared again at once, which agrees
        run(2 * PAIR_MIN_STEPS)
        assert comparisons == [2, 3] and policy.lookup[2] == 0
    stale_after = math.ceil(math.log(PAIR_STALE) / math.log(PAIR_KEEP_PER_GENERATE))
    losing_waits = math.ceil((1 / ratio - 1) / RETRY_SHARE) if ratio < 1 else 0
    stale = PAIR_STALE * PAIR_KEEP_PER_GENERATE ** min(max(losing_waits - stale_after, 0), PAIR_LOSING_EXTRA_MAX)
    settled = list(comparisons)
    while len(comparisons) == len(settled):
        run(PAIR_MIN_STEPS)
        assert generate < settled[-1] + 40
    worth = [sum(PAIR_KEEP_PER_GENERATE ** (g - c) for c in settled) for g in range(settled[-1] + 1, generate + 1)]
    assert all(w >= stale for w in worth[:-1]) and worth[-1] < stale  # the first generate under it compares
    assert worth[-1] >= PAIR_FORGET  # the evidence still decides at the generate that compares
    assert policy.lookup[2] == want


def test_a_generate_may_draft_where_its_schedule_or_a_comparison_drafts_and_only_there():
    """What the engine asks as a generate starts (drafts_this_generate; a DSpark proposer keeps no states for a
    catch-up where the answer is no): with the block slower than plain decoding at 2 rows, some generate has a
    schedule of plain decoding at every batch size and compares there, and may draft (and does); some generate
    has that schedule and compares nowhere, and may not; no generate told no drafts."""
    policy = flat_sized_policy()
    block, plain = sized_step(2, 3, 3, 3.0, 0.1, 8), sized_step(2, 0, 0, 0.5, 0.0, 2)
    seen = set()
    for _ in range(8):
        may, plain_everywhere, compares = policy.drafts_this_generate(), not any(policy.lookup), bool(policy.comparing)
        ks = run_sized_generate(policy, PAIR_MIN_STEPS, block, plain)
        assert may or 3 not in ks
        if plain_everywhere:
            seen.add((compares, may, 3 in ks))
    assert seen == {(True, True, True), (False, False, False)}


def test_a_comparisons_ratio_counts_over_the_acceptance_its_own_drafts_measured():
    """Right after a comparison the paired ratio is the one its generate measured (the direct formula: tokens
    over a verify's and a drafting's mean seconds, each option), though the acceptance estimate fell during
    that generate, from every draft accepted to one row in two accepting the first draft and none the second:
    a ratio counts over the block's expected tokens after its generate's drafts, not before them."""
    policy = flat_sized_policy()
    steps, plain = 2 * PAIR_MIN_STEPS, sized_step(2, 0, 0, 0.5, 0.0, 2)
    every_draft = StepRecord(2, 3, 0.2, 3, 0.1, 8, [2, 2, 2], [2, 2, 2])
    half_the_first = StepRecord(2, 3, 0.2, 3, 0.1, 3, [2, 1, 0], [1, 0, 0])
    assert run_sized_generate(policy, steps, every_draft, plain) == [3] * steps  # due for a comparison
    before = policy.tokens[3]
    assert run_sized_generate(policy, steps, half_the_first, plain)[:PAIR_RUN_STEPS] == [0] * PAIR_RUN_STEPS
    assert policy.tokens[3] < 0.8 * before  # the estimate fell in the comparing generate
    assert policy.paired_ratio(2) == pytest.approx((3 / (0.2 + 0.1)) / (2 / 0.5))


@pytest.mark.parametrize("fluke", [True, False], ids=["one-comparison-overturned", "control-agrees"])
def test_a_comparison_whose_verdict_differs_from_the_last_is_repeated_until_two_agree(fluke):
    """A comparison whose verdict (the block DRAFT_MARGIN faster, or not) differs from the bucket's last one (at
    its first comparison: the schedule the generate ran there) makes the next generate compare there again, until
    two verdicts in a row agree; the schedule follows the paired evidence meanwhile. Here the block is 6.7x plain
    decoding and one comparison, overturned by a machine 10x slower during its block steps, says 0.67x: the
    generates after it compare again (plain steps first, then the block), twice: the first repeat disagrees
    with the overturned verdict, the second agrees with the first repeat; the evidence then drafts the block
    (the direct formula: the weighted mean of the two logs, ln 0.67 kept 0.9, each ratio over the block's
    expected tokens after its generate, times those now). The control, every
    comparison agreeing with the schedule, compares once and not at the next generate."""
    policy = flat_sized_policy()
    block, plain = sized_step(2, 3, 3, 0.2, 0.1, 8), sized_step(2, 0, 0, 0.5, 0.0, 2)
    slow = sized_step(2, 3, 3, 2.0, 1.0, 8)  # the block's steps on a machine 10x slower: (8 / 3) / 4 = 0.67x plain
    steps, compared = 2 * PAIR_MIN_STEPS, [0] * PAIR_RUN_STEPS + [3] * (2 * PAIR_MIN_STEPS - PAIR_RUN_STEPS)
    assert run_sized_generate(policy, steps, block, plain) == [3] * steps  # the price drafts; due for a comparison
    assert run_sized_generate(policy, steps, slow if fluke else block, plain) == compared
    overturned_at = policy.tokens[3]  # a ratio counts over the block's expected tokens after its generate
    assert policy.lookup[2] == (0 if fluke else 3)  # the paired evidence decides
    if fluke:
        assert run_sized_generate(policy, steps, block, plain) == compared  # differs from the overturned verdict
        repeated_at = policy.tokens[3]
        assert policy.lookup[2] == 3
        ratio = math.exp((PAIR_KEEP_PER_GENERATE * math.log((8 / 3) / 4 / overturned_at) +
                          math.log((8 / 0.3) / 4 / repeated_at)) / (1 + PAIR_KEEP_PER_GENERATE)) * policy.tokens[3]
        assert policy.paired_ratio(2) == pytest.approx(ratio) and ratio >= 1 + DRAFT_MARGIN
        assert run_sized_generate(policy, steps, block, plain) == compared  # agrees with the one before: settled
    assert run_sized_generate(policy, steps, block, plain) == [3] * steps


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
        policy.verification_size(1, torch.ones(1, 3))  # a sized step: the sized schedule from here on
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

    def verification_size(self, batch_size, survival):
        return (survival >= 0.5).sum(1)


class RowsPeekAtTheNextSurvival(FixedKAskingConfidences):
    """The negative control: a row verifies both drafts when the survival of slot 1 is >= 0.04, else none;
    that survival depends on the token drawn at slot 0, so slot 0's draft is verified according to its
    own value."""

    def verification_size(self, batch_size, survival):
        return torch.where(survival[:, 1] >= 0.04, 2, 0)


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
    assert "dspark_noise_token_id 32" in refusal(TARGET, copy_draft(tmp_path, lambda raw: raw.update(
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


@pytest.mark.parametrize("catch_up_s, entered_from_plain, drafts",
                         [(5.0, True, False), (3.0, True, True), (5.0, False, True)],
                         ids=["dear-switch", "cheap-switch", "control-no-switch"])
def test_a_run_of_drafting_buckets_entered_from_plain_decoding_drafts_only_where_the_catch_up_pays(
        catch_up_s, entered_from_plain, drafts):
    """Rows that drain from a plain bucket into drafting ones catch up their draft context once; the schedule
    drafts there only while that catch-up (the seconds per position caught up so far times the positions the
    rows held at their first step there) costs less than drafting saved there in the ending generate: at each
    bucket its tokens at plain decoding's price per token times 1 - plain's rate over the block's (the direct
    formula below, on the profile alone). Control: the same dear catch-up where the generate started at the
    drafting buckets (no plain bucket above them), so it never switches."""
    grid = [1, 2, 4]
    verify = {q: [1.0 + 0.05 * q, 1.1 + 0.1 * q, 1.2 + 1.5 * q] for q in range(4)}
    draft = {k: [0.2 * (k > 0), 0.2 * (k > 0), 0.3 * (k > 0)] for k in range(4)}
    policy = ConfidenceSizedK(3)
    policy.corrects_costs = False  # the profile is the whole price: the formula below needs no measured offsets
    policy.set_costs(grid, verify, draft)
    policy.verification_size(2, torch.ones(2, 3))  # a sized step: the sized schedule from here on
    policy.begin()
    assert [policy.lookup[b] for b in (1, 2, 3, 4)] == [3, 3, 3, 0]  # the price: the block below 4 rows
    positions, context_at_2 = 10, 20
    if entered_from_plain:
        for _ in range(2):
            policy.observe(StepRecord(4, 0, verify[0][2], 0, 0.0, 4, [0] * 3, [0] * 3, context=40))
    policy.observe(StepRecord(2, 3, verify[3][1], 3, draft[3][1] + catch_up_s, 6, [0] * 3, [0] * 3,
                              context=context_at_2, caught_up=(positions, catch_up_s)))
    policy.observe(StepRecord(2, 3, verify[3][1], 3, draft[3][1], 6, [0] * 3, [0] * 3, context=context_at_2 + 8))
    for context in (13, 16):
        policy.observe(StepRecord(1, 3, verify[3][0], 3, draft[3][0], 3, [0] * 3, [0] * 3, context=context))
    policy.begin()

    def saves(i, b, tokens):  # every draft passes (the sized prior): a step verifying q emits 1 + q a row
        rate = [(1 + q) / (verify[q][i] + draft[3][i]) for q in range(4)]
        q = next((q for q in range(3) if rate[q + 1] <= rate[q]), 3)
        return tokens * verify[0][i] / b * (1 - 1 / (rate[q] * verify[0][i]))
    pays = saves(1, 2, 12) + saves(0, 1, 6) >= catch_up_s / positions * context_at_2
    assert pays == (catch_up_s == 3.0)  # the cases sit either side of the line
    assert [policy.lookup[b] for b in (1, 2, 3)] == ([3] * 3 if drafts else [0] * 3)
    assert policy.lookup[4] == 0


@pytest.mark.parametrize("tokens_a_step, compared", [(8, True), (2, False)], ids=["block-steps", "control"])
def test_a_bucket_is_compared_by_the_tokens_a_row_it_emitted_not_its_steps(tokens_a_step, compared):
    """A bucket where the block drafts runs fewer steps than plain decoding would for its tokens; what makes it due
    for a comparison is PAIR_MIN_STEPS tokens a row in the ending generate: here fewer steps than that, at 4 tokens
    a row each, qualify; the control, the same steps at 1 token a row, does not."""
    policy = flat_sized_policy()
    steps = PAIR_MIN_STEPS // 2
    block = sized_step(2, 3, 3, 0.2, 0.1, tokens_a_step)
    assert run_sized_generate(policy, steps, block, block) == [3] * steps
    assert (steps * tokens_a_step / 2 >= PAIR_MIN_STEPS) == compared
    ks = run_sized_generate(policy, steps, block, block)
    assert ks == ([0] * PAIR_RUN_STEPS + [3] * (steps - PAIR_RUN_STEPS) if compared else [3] * steps)


@pytest.mark.parametrize("pairs", [1, 2], ids=["drained", "control"])
def test_a_drained_buckets_choice_and_switch_price_read_its_rates_from_one_step_of_each(pairs):
    """At a bucket the ending generate ran fewer than RATE_STEPS steps at (one a batch drains through: decayed
    by COST_KEEP_PER_GENERATE, its steps never add up to RATE_STEPS), the block's rate and plain decoding's are
    read from a step of each (the direct formula: each option's tokens over its verify's and drafting's
    seconds), for the saving a switch is priced against and for the choice there: plain decoding, measured
    faster. The control ran RATE_STEPS steps there, fewer of each: the measured choice waits for RATE_STEPS of
    each."""
    policy = flat_sized_policy()
    policy.begin()  # the first generate's steps are not rated
    for _ in range(pairs):
        policy.observe(sized_step(2, 3, 3, 1.2, 0.3, 6))
        policy.observe(sized_step(2, 0, 0, 0.4, 0.05, 2))
    block, plain = 6 / (1.2 + 0.3), 2 / (0.4 + 0.05)
    assert policy.block_ratio(2) == pytest.approx(block / plain) and block < plain
    assert (2 * pairs < RATE_STEPS) == (pairs == 1)
    policy.begin()
    assert policy.measured_choice(2) == (0 if pairs == 1 else None)
    assert pairs == 2 or policy.lookup[2] == 0
