"""The adaptive k policy against direct formulas: its per-batch-size schedule is the brute-force
argmax of expected tokens per second over the cost profile and the acceptance estimate; the
estimate is the prior-shrunk row rate and drifts back to the prior across new weights; the
profile envelope. Then the real engine on constructed scenarios, by counts of drafted and
verified tokens: a draft never accepted costs no drafting after the first generate, a draft
always accepted is drafted to k_max where the step cost is flat."""
import itertools
import random

import numpy as np
import pytest

from rollout.embedded.engine import EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.embedded.spec_policy import ACCEPT_KEEP_PER_LOAD, ACCEPT_PRIOR, ACCEPT_PRIOR_ROWS, COST_FORGET_STEPS, \
    COST_KEEP_PER_GENERATE, AdaptiveK, StepRecord
from rollout.embedded.step_costs import batch_grid, monotone_envelope
from rollout.sampling_params import SamplingParams
from spec_fixtures import markov_model, one_thread, save_checkpoint  # noqa: F401
from vime.sample import samples_for_prompts


def brute_force_tokens(conditional, k):
    """E[1 + leading accepted drafts] by enumerating every accept / reject pattern of k drafts."""
    expected = 0.0
    for pattern in itertools.product([0, 1], repeat=k):
        prob, lead = 1.0, 0
        for i, bit in enumerate(pattern):
            prob *= conditional[i] if bit else 1 - conditional[i]
        while lead < k and pattern[lead]:
            lead += 1
        expected += prob * (1 + lead)
    return expected


def brute_force_schedule(grid, step_s, conditional, max_batch_size):
    """k(B) = argmax_k B E(k) / cost(B, k) with the cost linear between grid points (numpy's
    interpolation), the smaller k on a tie."""
    k_max = len(conditional)
    table = [0]
    for b in range(1, max_batch_size + 1):
        rates = [b * brute_force_tokens(conditional, k) / float(np.interp(b, grid, step_s[k]))
                 for k in range(k_max + 1)]
        best = max(rates)
        table.append(min(k for k in range(k_max + 1) if rates[k] >= best * (1 - 1e-12)))
    return table


def observe_rows(policy, batch_size, reached, accepted, k=None):
    """A step that took what the profile priced it at (no cost correction), or 1.1 ms without one."""
    k = len(reached) if k is None else k
    seconds = policy.costs[min(batch_size, len(policy.costs) - 1)][k] if policy.costs is not None else 1.1e-3
    policy.observe(StepRecord(batch_size, k, seconds * 10 / 11, k, seconds / 11, batch_size, list(reached),
                              list(accepted)))


def memory_bound(grid, k_max, draft_share=0.05):
    """A GPU-like profile: verifying 1+k tokens costs what 1 costs, a drafted token draft_share of a
    step; the step grows with rows."""
    return {k: [(1 + 0.01 * b) * (1 + draft_share * k) for b in grid] for k in range(k_max + 1)}


def compute_bound(grid, k_max, full=8):
    """A CPU-like profile: at 1 row a drafted token costs 5 % of a step, at `full` rows as much as a
    step (verifying 1+k tokens costs 1+k steps), plus the draft's 5 %."""
    return {k: [b * (1 + k * (0.05 + 0.95 * min(b, full) / full) + 0.05 * k) for b in grid]
            for k in range(k_max + 1)}


@pytest.mark.parametrize("seed", range(12))
def test_the_schedule_is_the_brute_force_argmax_over_the_profile_and_the_acceptance(seed):
    rng = random.Random(seed)
    k_max, max_batch = rng.choice([1, 2, 3]), rng.choice([8, 24, 64])
    grid = batch_grid(max_batch)
    profiles = [memory_bound(grid, k_max), compute_bound(grid, k_max),
                {k: sorted(rng.uniform(1, 3) * (1 + 0.3 * k) * b for b in grid) for k in range(k_max + 1)}]
    p = AdaptiveK(k_max)
    p.set_profile(grid, profiles[seed % 3])
    for _ in range(rng.randint(0, 20)):  # some evidence at random rates, every position reached less often
        reached = [rng.randint(0, 16)]
        for _ in range(k_max - 1):
            reached.append(rng.randint(0, reached[-1]))
        observe_rows(p, 16, reached, [rng.randint(0, r) for r in reached])
    p.begin(0)
    want = brute_force_schedule(grid, profiles[seed % 3], p.acceptance(), max_batch)
    assert p.lookup == want
    assert [p.choose(b) for b in range(1, max_batch + 1)] == want[1:]


def test_the_acceptance_estimate_is_the_row_rate_shrunk_toward_the_previous_position():
    p = AdaptiveK(3)
    observe_rows(p, 100, [100, 80, 3], [80, 2, 3])
    observe_rows(p, 1, [1, 1, 1], [1, 1, 1])
    m = ACCEPT_PRIOR_ROWS
    first = (81 + m * ACCEPT_PRIOR) / (101 + m)
    second = (3 + m * first) / (81 + m)
    third = (4 + m * second) / (4 + m)
    assert p.acceptance() == pytest.approx([first, second, third])
    assert third < 0.5  # position 3 seen in 4 rows, all accepted, stays near position 2's rate


def test_a_draft_never_accepted_is_drafted_at_no_batch_size():
    p = AdaptiveK(3)
    grid = batch_grid(64)
    p.set_profile(grid, memory_bound(grid, 3, draft_share=0.02))  # drafting as cheap as it gets
    p.begin(0)
    assert set(p.lookup[1:]) == {3}  # at the prior acceptance drafting pays
    for _ in range(20):
        observe_rows(p, 32, [32, 0, 0], [0, 0, 0])
    p.begin(0)
    assert set(p.lookup) == {0}


def test_a_perfect_draft_on_flat_costs_is_drafted_to_k_max_everywhere():
    p = AdaptiveK(3)
    grid = batch_grid(64)
    p.set_profile(grid, {k: [1.0 + 0.01 * b for b in grid] for k in range(4)})
    for _ in range(5):
        observe_rows(p, 8, [8, 8, 8], [8, 8, 8])
    p.begin(0)
    assert set(p.lookup[1:]) == {3}


def test_a_perfect_draft_on_a_compute_bound_profile_is_drafted_on_few_rows_only():
    grid = batch_grid(64)
    profile = compute_bound(grid, 3)
    p = AdaptiveK(3)
    p.set_profile(grid, profile)
    for _ in range(5):
        observe_rows(p, 8, [8, 8, 8], [8, 8, 8])
    p.begin(0)
    assert p.lookup[1] == 3 and p.lookup[64] == 0
    assert p.lookup == brute_force_schedule(grid, profile, p.acceptance(), 64)
    assert p.lookup[1:] == sorted(p.lookup[1:], reverse=True)  # k falls as rows grow, never rises


def test_evidence_shrinks_toward_the_prior_on_new_weights_so_drafting_is_tried_again():
    """After many rows at acceptance 0 nothing is drafted; more generates on the same weights keep
    the evidence; each generate on new weights keeps ACCEPT_KEEP_PER_LOAD of the counts (direct
    formula), and once the estimate is back near the prior drafting is tried where it would pay."""
    p = AdaptiveK(2)
    grid = batch_grid(16)
    p.set_profile(grid, memory_bound(grid, 2, draft_share=0.1))
    p.begin(0)
    for _ in range(30):
        observe_rows(p, 16, [16, 0], [0, 0])
    drafted = p.drafted[0]
    for _ in range(5):
        p.begin(0)
        assert set(p.lookup) == {0} and p.drafted[0] == drafted
    for version in range(1, 4):
        p.begin(version)
        m, d = ACCEPT_PRIOR_ROWS, drafted * ACCEPT_KEEP_PER_LOAD ** version
        assert p.acceptance()[0] == pytest.approx(m * ACCEPT_PRIOR / (d + m))
    assert set(p.lookup) == {0}  # 480 rows -> 60: still below what pays
    for version in range(4, 12):
        p.begin(version)
    assert p.acceptance()[0] > 0.4 and max(p.lookup) > 0


def test_the_summary_traces_k_and_predicted_against_measured_speedup():
    """spec_k_mean is the row-weighted k chosen; the predicted speedup is the schedule's expected
    tokens per profiled second over plain's, the measured one the emitted tokens per measured
    second over plain's profiled rate (direct formulas on two steps)."""
    p = AdaptiveK(1)
    p.set_profile([1, 2, 4], {0: [1.0, 1.5, 2.5], 1: [1.2, 1.8, 3.0]})
    for _ in range(4):
        observe_rows(p, 4, [4], [3])
    p.begin(0)
    assert p.choose(4) == p.choose(2) == 1
    e1 = p.tokens[1]
    p.observe(StepRecord(4, 1, 2.8, 1, 0.4, 7, [4], [3]))
    p.observe(StepRecord(2, 1, 1.5, 1, 0.2, 3, [2], [1]))
    plain_rate = 10 / (7 * 2.5 / 4 + 3 * 1.5 / 2)
    s = p.summary()
    assert s["spec_k_mean"] == 1.0
    assert s["spec_predicted_speedup"] == pytest.approx((6 * e1 / 4.8) / plain_rate)
    assert s["spec_measured_speedup"] == pytest.approx((10 / 4.9) / plain_rate)


def test_batch_grid_covers_the_engine_slots():
    assert batch_grid(1) == [1] and batch_grid(16) == [1, 2, 4, 8, 16] and batch_grid(100)[-1] == 100


def test_profile_envelope_caps_each_point_by_every_point_doing_at_least_as_much_work():
    """Timing noise only adds, so a point is lowered to the cheapest point with >= rows and >= k
    (direct definition, brute force), and a profile that is already monotone is left alone."""
    rng = random.Random(0)
    for _ in range(50):
        raw = {k: [rng.uniform(1, 10) for _ in range(5)] for k in range(4)}
        got = monotone_envelope(raw)
        for k in raw:
            for j in range(5):
                want = min(raw[k2][j2] for k2 in raw if k2 >= k for j2 in range(5) if j2 >= j)
                assert got[k][j] == want
    monotone = {k: [(1 + k) * (1 + j) for j in range(5)] for k in range(4)}
    assert monotone_envelope(monotone) == monotone


def block_draft(grid, k_max, context=0.5, block=0.6, context_at_k0=True):
    """A DFlash-like CPU profile: verifying 1+k tokens costs (1 + 0.05 k) per row at 1 row and more
    as rows grow (compute_bound), every step writes the verified positions into the draft's context
    (`context` of a plain step, also at k = 0 unless `context_at_k0` is False: the price before
    k = 0 counted it), and a step with drafts adds one block forward whose cost is the same for any k."""
    verify = compute_bound(grid, k_max)
    return {k: [v + b * ((context if k or context_at_k0 else 0.0) + (block if k else 0.0))
                for v, b in zip(verify[k], grid)] for k in range(k_max + 1)}


def clear_choices(grid, step_s, conditional, max_batch_size, margin=1.1):
    """{B: k} of the brute-force argmax at the batch sizes where the best k's tokens/s beats every
    other k's by `margin` (elsewhere an estimate from finitely many rows may rightly pick either)."""
    out = {}
    for b in range(1, max_batch_size + 1):
        rates = sorted(((brute_force_tokens(conditional, k) / float(np.interp(b, grid, step_s[k])), k)
                        for k in range(len(conditional) + 1)), reverse=True)
        if rates[0][0] >= margin * rates[1][0]:
            out[b] = rates[0][1]
    return out


def drain(policy, conditional, rng, generates=12, rows=16):
    """Generates of a batch draining from `rows` rows to one, each step drafting the k the policy
    chooses and accepting each draft position with its `conditional` rate (given the one before);
    the policy observes every step. Returns the draft positions drafted over all steps."""
    drafted = 0
    for version in range(generates):
        policy.begin(version)
        for b in range(rows, 0, -1):
            k = policy.choose(b)
            reached, accepted, live = [0] * policy.k, [0] * policy.k, b
            for i in range(k):
                reached[i] = live
                live = sum(rng.random() < conditional[i] for _ in range(live))
                accepted[i] = live
            drafted += sum(reached)
            observe_rows(policy, b, reached, accepted, k)
    policy.begin(generates)
    return drafted


@pytest.mark.parametrize("pays", [True, False], ids=["block-pays", "block-does-not-pay"])
def test_adaptive_k_tries_a_block_and_keeps_it_only_where_it_pays(pays):
    """A block draft on a CPU-like profile where a step without drafts still writes the draft's
    context. From the prior alone, the policy drafts the block at few rows (the block is cheap next
    to a step that writes context anyway), measures its acceptance, and ends on the brute-force
    schedule of the true acceptance over the true costs: the block at 1 row where it pays (0.9 /
    0.85 / 0.8 by position), nothing anywhere where it does not (0.02 / 0.5 / 0.5)."""
    k_max, rows = 3, 16
    grid = batch_grid(rows)
    conditional = [0.9, 0.85, 0.8] if pays else [0.02, 0.5, 0.5]
    policy = AdaptiveK(k_max)
    policy.set_profile(grid, block_draft(grid, k_max))
    drafted = drain(policy, conditional, random.Random(0), rows=rows)
    want = clear_choices(grid, block_draft(grid, k_max), conditional, rows)
    assert drafted > 0  # the block was tried in both cases
    assert {b: policy.lookup[b] for b in want} == want
    assert (want[1] == k_max) if pays else (set(want.values()) == {0} and set(policy.lookup) == {0})


def test_a_block_priced_without_the_context_write_at_k0_is_never_tried_negative_control():
    """The same paying block with k = 0 priced as plain decoding (no context write): from the prior
    the block looks dearer than it is, is never drafted, and its acceptance never measured."""
    k_max, rows = 3, 16
    grid = batch_grid(rows)
    policy = AdaptiveK(k_max)
    policy.set_profile(grid, block_draft(grid, k_max, context_at_k0=False))
    assert drain(policy, [0.9, 0.85, 0.8], random.Random(0), rows=rows) == 0
    assert set(policy.lookup) == {0}


# ---------------------------------------------------------------- the real engine, counts only
K, SLOTS = 3, 8
pytestmark = pytest.mark.usefixtures("one_thread")


class Recorded(AdaptiveK):
    """The adaptive policy, recording every (batch size, k) it chose."""

    def __init__(self, k_max):
        super().__init__(k_max)
        self.chosen, self.begin_acceptance = [], None

    def begin(self, weight_version=None):
        super().begin(weight_version)
        self.begin_acceptance = self.acceptance()  # what this generate's schedule was written from

    def choose(self, batch_size):
        k = super().choose(batch_size)
        self.chosen.append((batch_size, k))
        return k


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(markov_model(noise=0.2), str(tmp_path_factory.mktemp("markov")))


def synthetic_engine(ckpt, rate, profile=None):
    """The embedded engine with MTP drafts whose acceptance is set (synthetic verification) and the
    adaptive policy, on this machine's profile or a constructed one."""
    spec = {"method": "mtp", "num_speculative_tokens": K, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rate": rate}
    engine = build_engine(ckpt, spec, EngineConfig(max_batch_size=SLOTS), adaptive=True)
    policy = Recorded(K)
    if profile is None:
        policy.costs = engine.k_policy.costs  # taken by build_engine
    else:  # a profile of another machine: this one's step times must not correct it
        policy.set_profile(batch_grid(SLOTS), profile(batch_grid(SLOTS), K))
        policy.corrects_costs = False
    engine.k_policy = policy
    return engine


def run(engine, prompts=20, tokens=16):
    sampling = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)
    return engine.generate(samples_for_prompts([[1, 4 + i % 20, 7] for i in range(prompts)]), sampling)


@pytest.mark.parametrize("profile", [None, memory_bound], ids=["this-machine", "memory-bound"])
def test_a_draft_never_accepted_costs_no_drafting_after_the_first_generate(ckpt, profile):
    """The first generate drafts at the prior wherever that would pay; from the second on nothing
    is drafted at any batch size, so every row takes plain decoding's target forwards."""
    plain = run(build_engine(ckpt, None, EngineConfig(max_batch_size=SLOTS)))
    engine = synthetic_engine(ckpt, 0.0, profile)
    first = run(engine)
    if profile is not None:  # the constructed profile makes drafting pay at the prior
        assert sum(s.spec.draft_tokens for s in first) > 0
    for _ in range(2):
        engine.k_policy.chosen.clear()
        samples = run(engine)
        assert sum(s.spec.draft_tokens for s in samples) == 0
        assert [s.spec.verify_steps for s in samples] == [s.spec.verify_steps for s in plain]
        assert [s.response_ids for s in samples] == [s.response_ids for s in plain]  # nothing drafted: plain's tokens
        assert {k for _, k in engine.k_policy.chosen} == {0}


@pytest.mark.parametrize("profile", [memory_bound, compute_bound], ids=["memory-bound", "compute-bound"])
def test_a_draft_always_accepted_is_drafted_to_k_max_on_few_rows(ckpt, profile):
    """Every draft accepted: after the first generate the policy drafts k_max at every step of 1-2
    rows, and every step of the second generate drafts the schedule's k for its batch size (the
    brute-force argmax at the measured rate, ~1); on the memory-bound profile that is k_max at
    every batch size."""
    engine = synthetic_engine(ckpt, 1.0, profile)
    run(engine, prompts=2 * SLOTS + 2)  # the last 2 rows run alone: steps at 1-2 rows
    engine.k_policy.chosen.clear()
    samples = run(engine, prompts=2 * SLOTS + 2)
    policy = engine.k_policy
    want = brute_force_schedule(batch_grid(SLOTS), profile(batch_grid(SLOTS), K), policy.begin_acceptance, SLOTS)
    assert [k for b, k in policy.chosen] == [want[b] for b, _ in policy.chosen]
    assert {k for b, k in policy.chosen if b <= 2} == {K}
    if profile is memory_bound:
        assert {k for _, k in policy.chosen} == {K}
    assert sum(s.spec.accepted_tokens for s in samples) == sum(s.spec.draft_tokens for s in samples) > 0


def test_steps_dearer_than_their_profile_move_the_schedule_as_the_corrected_costs_say():
    # the profile prices drafting as nearly free; real k-draft steps take `factor` times that: the next
    # schedule is the brute-force argmax over the profile with each k's measured/profiled ratio, and a
    # k never run is priced at the largest ratio seen
    k_max, max_b = 2, 32
    grid = batch_grid(max_b)
    step_s = {k: [(1 + 0.01 * b) * (1 + 0.05 * k) for b in grid] for k in range(k_max + 1)}
    policy = AdaptiveK(k_max)
    policy.set_profile(grid, step_s)
    policy.begin(0)
    factor = {0: 1.0, 1: 2.2}
    for k in (0, 1):
        for b in (4, 16, 32):
            profiled = policy.costs[b][k]
            policy.observe(StepRecord(b, k, profiled * factor[k], k, 0.0, b, [b] * k + [0] * (k_max - k),
                                      [int(0.6 * b)] * k + [0] * (k_max - k)))
    conditional = policy.acceptance()
    policy.begin(0)
    corrected = {k: [s * factor.get(k, max(factor.values())) for s in step_s[k]] for k in step_s}
    assert policy.lookup == brute_force_schedule(grid, corrected, conditional, max_b)
    assert policy.lookup != brute_force_schedule(grid, step_s, conditional, max_b)  # the correction mattered


def test_plain_decoding_not_run_yet_is_priced_at_its_probe_against_drafting_steps_dearer_than_theirs():
    # the profile prices a 1-draft step 1.1x a plain one and the draft is accepted at 0.3, so drafting pays by
    # the profile; real 1-draft steps take 1.3x their price and no plain step has run. The next schedule is the
    # brute-force argmax with k = 0 at its probe (ratio 1) and the drafting ks at 1.3: no drafting anywhere.
    # Negative control: plain decoding priced at the drafting steps' ratio would keep drafting everywhere.
    k_max, max_b = 1, 8
    grid = batch_grid(max_b)
    step_s = {k: [1.0 + 0.01 * b + 0.1 * k for b in grid] for k in range(k_max + 1)}
    policy = AdaptiveK(k_max)
    for _ in range(50):  # acceptance 0.3 over 400 rows (before the profile: no cost evidence)
        observe_rows(policy, 8, [8], [0.3 * 8])
    policy.set_profile(grid, step_s)
    policy.begin(0)
    assert set(policy.lookup[1:]) == {1}  # drafting pays at the profiled prices
    for b in (1, 4, 8):
        policy.observe(StepRecord(b, 1, 1.3 * policy.costs[b][1], 1, 0.0, b, [b], [0.3 * b]))
    conditional = policy.acceptance()
    policy.begin(0)
    assert policy.cost_correction() == pytest.approx([1.0, 1.3])
    corrected = {0: step_s[0], 1: [1.3 * s for s in step_s[1]]}
    assert policy.lookup == brute_force_schedule(grid, corrected, conditional, max_b)
    assert set(policy.lookup[1:]) == {0}
    both_dearer = {k: [1.3 * s for s in step_s[k]] for k in step_s}
    assert set(brute_force_schedule(grid, both_dearer, conditional, max_b)[1:]) == {1}


def test_a_cost_correction_not_measured_again_is_forgotten_so_the_k_is_tried_again():
    """One generate's k = 2 steps took 3x their profile (a cold start, a burst of load) and priced
    k = 2 out; k = 0 steps keep running at their profile. The k = 2 evidence halves at each
    generate (COST_KEEP_PER_GENERATE) and, once worth less than COST_FORGET_STEPS 1-row steps, is
    dropped (direct formula for when): from then k = 2 takes k = 0's correction (1) and, a perfect
    draft on flat costs paying, is drafted again."""
    k_max, max_b = 2, 8
    grid = batch_grid(max_b)
    p = AdaptiveK(k_max)
    for _ in range(20):
        observe_rows(p, 8, [8, 8], [8, 8])  # acceptance ~1 (before the profile: no cost evidence)
    p.set_profile(grid, {k: [1.0 + 0.01 * b + 0.1 * k for b in grid] for k in range(k_max + 1)})
    p.begin(0)
    assert set(p.lookup[1:]) == {2}  # k = 2 pays at its profiled price
    for _ in range(3):  # k = 2 steps at 3x their profile
        p.observe(StepRecord(4, 2, 3 * p.costs[4][2], 2, 0.0, 12, [4, 4], [4, 4]))
    evidence = 3 * p.costs[4][2]  # profiled seconds of those steps
    kept = []
    for generate in range(1, 8):
        p.observe(StepRecord(4, 0, p.costs[4][0], 0, 0.0, 4, [0, 0], [0, 0]))  # k = 0 at its price
        correction = p.cost_correction()  # what this generate's schedule is written with
        p.begin(0)
        # the evidence this schedule saw survived every earlier generate's decay and forgetting
        kept.append(evidence * COST_KEEP_PER_GENERATE ** (generate - 1) >= COST_FORGET_STEPS * p.costs[1][2])
        assert correction[2] == pytest.approx(3.0 if kept[-1] else 1.0)
        assert set(p.lookup[1:]) == ({0} if kept[-1] else {2})
    assert kept[0] and not kept[-1]  # priced out first, tried again later
