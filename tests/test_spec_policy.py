"""The adaptive k policy's choice against a direct computation of expected tokens per second,
its cost table (profile interpolation, online refinement, the monotone profile envelope) and
its acceptance estimate."""
import itertools
import math

import pytest

from rollout.embedded.spec_policy import ACCEPT_BAND_PRIOR_ROWS, ACCEPT_PRIOR, ACCEPT_PRIOR_ROWS, ACCEPT_WINDOW_ROWS, ROW_CORRELATION, SWITCH_MARGIN, expected_tokens, EXPLORE_EVERY, AdaptiveK, CostTable, StepRecord, batch_band, batch_grid, monotone_envelope


def policy_with(verify_ms, draft_ms, acceptance, grid=(1, 16)):
    """An AdaptiveK whose profile says: verify_ms[k], draft_ms[k] at every batch size."""
    p = AdaptiveK(len(acceptance))
    p.verify = CostTable(list(grid), {k: [v] * len(grid) for k, v in enumerate(verify_ms)})
    p.draft = CostTable(list(grid), {k: [d] * len(grid) for k, d in enumerate(draft_ms)})
    p.acceptance = list(acceptance)
    return p


def brute_force_best(verify_ms, draft_ms, conditional):
    """argmax over k of (tokens per row) / (step time), tokens enumerated over accept patterns."""
    best, best_rate = 0, -1.0
    for k in range(len(conditional) + 1):
        expected = 0.0  # E[1 + leading accepted drafts] by enumerating every accept/reject pattern
        for pattern in itertools.product([0, 1], repeat=k):
            prob, lead, leading = 1.0, 0, True
            for i, bit in enumerate(pattern):
                prob *= conditional[i] if bit else 1 - conditional[i]
                if leading and bit:
                    lead += 1
                else:
                    leading = False
            expected += prob * (1 + lead)
        rate = expected / (verify_ms[k] + draft_ms[k])
        if rate > best_rate + 1e-12:
            best, best_rate = k, rate
    return best


@pytest.mark.parametrize("acceptance", [(0.9, 0.8, 0.7), (0.8, 0.3, 0.1), (0.3, 0.1, 0.0), (0.0, 0.0, 0.0),
                                        (0.95, 0.2, 0.9)])
@pytest.mark.parametrize("costs", [((1.0, 1.05, 1.1, 1.2), (0, 0.1, 0.2, 0.3)),   # memory-bound: verify is flat
                                   ((1.0, 2.0, 3.0, 4.0), (0, 0.3, 0.6, 0.9))])   # compute-bound: (1+k)x
def test_adaptive_choice_maximises_expected_tokens_per_second(acceptance, costs):
    verify_ms, draft_ms = costs
    p = policy_with(verify_ms, draft_ms, acceptance)
    assert p.best_k(4) == brute_force_best(verify_ms, draft_ms, acceptance)


def test_a_stale_draft_is_still_probed_where_drafting_could_pay():
    """Acceptance 0 picks k = 0, but where a verify costs about one step (memory-bound) a better
    draft would pay, so every k is still probed now and then (the draft improves online)."""
    p = policy_with((1.0, 1.05, 1.1), (0, 0.1, 0.2), (0.0, 0.0))
    ks = [p.choose(8) for _ in range(200)]
    assert ks.count(0) >= 190 and set(ks) == {0, 1, 2}


def test_where_no_acceptance_could_pay_no_step_is_spent_probing():
    """Compute-bound: verify of 1+k tokens costs (1+k)x plus drafting, so even a perfect draft
    loses (k+1 tokens for more than k+1 steps' time): k = 0 every step, no probe."""
    p = policy_with((1.0, 2.0, 3.0), (0, 0.5, 1.0), (0.0, 0.0))
    assert [p.choose(64) for _ in range(200)] == [0] * 200
    p.verify = CostTable([1, 16], {0: [1.0, 1.0], 1: [1.05, 1.05], 2: [1.1, 1.1]})  # the batch became memory-bound
    p.draft = CostTable([1, 16], {0: [0, 0], 1: [0.1, 0.1], 2: [0.2, 0.2]})
    assert p.choose(2) != 0  # the probe that was due runs at once


def test_cost_table_interpolates_the_profile_and_prefers_measurements():
    t = CostTable([1, 4, 16], {0: [1.0, 2.0, 5.0]})
    assert t.predict(2, 0) == pytest.approx(1 + 1 / 3)
    assert t.predict(10, 0) == pytest.approx(3.5)
    t.update(10, 0, 7.0)  # twice the profile here
    assert t.predict(10, 0) == 7.0
    assert t.predict(4, 0) > 2.0  # the load seen at 10 raises the unseen points too


def test_costs_the_profile_misses_for_one_k_are_learnt_for_that_k_at_unseen_batch_sizes():
    """The profile prices a 2-token step at 1.2x a plain one; real steps measure 1.8x at k = 1
    and exactly the profile at k = 0. At a batch size never measured the policy must price k = 1
    at 1.8x (its own correction, not one shared with k = 0) and choose what the true costs favour."""
    profile_verify, true_verify, draft = (1.0, 1.2), (1.0, 1.8), (0.0, 0.0)
    p = policy_with(profile_verify, draft, (0.5,), grid=(1, 64))
    assert p.best_k(40) == 1  # what the profile alone says
    p.begin()
    for b in range(20, 30):  # alternate k at batch sizes other than 40
        for k in (0, 1):
            p.observe(StepRecord(b, k, true_verify[k], None, 0.0, b, [b] * k, [b // 2] * k))
    assert p.verify.predict(40, 1) / p.verify.predict(40, 0) == pytest.approx(1.8)
    assert p.best_k(40) == brute_force_best(true_verify, draft, p.acceptance) == 0


def best_by_formula(p, b, backlog, catch_up_s, horizon):
    """argmax over k of b E(k) / (verify + draft + [k > 0] backlog C / H), computed directly."""
    rates = [b * (1 + sum(math.prod(p.acceptance[:i + 1]) for i in range(k)))
             / (p.verify.predict(b, k) + p.draft.predict(b, k) + (backlog * catch_up_s / horizon if k else 0))
             for k in range(p.k + 1)]
    return max(range(p.k + 1), key=lambda k: (rates[k], -k))


@pytest.mark.parametrize("backlog", [0, 10, 100, 1000])
@pytest.mark.parametrize("previous_batches", [[], [4] * 2, [16, 8, 4, 4, 2, 1] * 5])
def test_a_switch_to_drafting_is_charged_the_catch_up_spread_over_the_steps_left(backlog, previous_batches):
    p = policy_with((1.0, 1.2, 1.4), (0.0, 0.1, 0.2), (0.6, 0.4))
    p.catch_up_s = 0.01
    p.batch_trace = list(previous_batches)
    p.begin()  # the previous generate's batch sizes set the horizon
    horizon = max(1, sum(1 for x in previous_batches if x <= 4))
    assert p.horizon(4) == horizon
    assert p.best_k(4, backlog) == best_by_formula(p, 4, backlog, 0.01, horizon)
    assert p.choose(4, backlog=lambda: backlog) == best_by_formula(p, 4, backlog, 0.01, horizon)  # no probe due
    if backlog == 0:
        assert p.best_k(4, backlog) > 0  # drafting pays here once nothing is deferred


def test_a_probe_pays_the_whole_catch_up_so_a_long_backlog_on_a_big_batch_is_not_probed():
    p = policy_with((1.0, 1.05, 1.1), (0.0, 0.1, 0.2), (0.0, 0.0))  # memory-bound, stale draft
    p.catch_up_s = 0.01
    assert [p.choose(64, backlog=lambda: 64 * 40) for _ in range(200)] == [0] * 200  # 25.6 s of catch-up: never
    assert [p.choose(2, backlog=lambda: 0) for _ in range(EXPLORE_EVERY)].count(0) < EXPLORE_EVERY  # due probe runs


def test_the_catch_up_cost_per_position_is_learnt_from_steps_that_caught_up():
    p = policy_with((1.0, 1.2), (0.0, 0.1), (0.5,))
    p.begin()
    for _ in range(60):  # a drafting step at 8 rows caught up 80 positions and took 0.9 s more than drafting
        p.observe(StepRecord(8, 1, 1.0, 1, 0.1 + 0.9, 8, [8], [4], caught_up=80))
    assert p.catch_up_s == pytest.approx(0.9 / 80, rel=1e-3)
    assert p.draft.predict(8, 1) == pytest.approx(0.1)  # not learnt as the cost of drafting 1


def test_a_k_measured_only_on_small_batches_is_priced_at_least_at_k0s_correction_on_a_large_one():
    t = CostTable([1, 8, 64], {0: [1.0, 2.0, 8.0], 1: [1.2, 2.4, 12.0]})
    for b in (2, 3):
        t.update(b, 1, 1.5 * t.profile_at(b, 1))  # k = 1 measured at 1.5x its profile, few rows only
    for b in (40, 50):
        t.update(b, 0, 1.9 * t.profile_at(b, 0))  # k = 0 at 1.9x on large batches
    assert t.predict(45, 1) == pytest.approx(1.9 * t.profile_at(45, 1))  # not 1.5x: below k = 0's there
    assert t.predict(5, 1) == pytest.approx(1.5 * t.profile_at(5, 1))  # measured in that interval


def test_a_probe_prices_an_unmeasured_k_at_the_profile_plus_k0s_missed_seconds_there():
    """The optimistic price (what a probe might find) of a k never measured in an interval is its
    profile plus the seconds k = 0's steps there take beyond their profile (direct formula): below
    k = 0's ratio applied to k's profile, which also multiplies the fixed miss. The decision price
    stays the pessimistic one."""
    t = CostTable([1, 8, 64], {0: [1.0, 2.0, 8.0], 1: [1.2, 3.0, 14.0]})
    for b in (40, 50):
        t.update(b, 0, t.profile_at(b, 0) + 2.0)  # k = 0 steps there miss a fixed 2 s
    miss = t.ratios[(0, t.interval(45))][0] * t.profile_at(45, 0) - t.profile_at(45, 0)
    assert t.predict(45, 1, optimistic=True) == pytest.approx(t.profile_at(45, 1) + miss)
    assert t.predict(45, 1, optimistic=True) < t.predict(45, 1)
    t.update(45, 1, 20.0)
    assert t.predict(45, 1, optimistic=True) == t.predict(45, 1) == 20.0  # measured: no optimism left


def test_a_due_probe_at_a_generates_first_step_is_charged_the_prompts_share_not_their_whole_pass():
    """At a generate's first step only the admitted prompts are deferred, and drafting that goes on
    pays their draft-layer pass once over the steps ahead: a due probe there is charged that
    share (it runs), where the same backlog mid-generate is charged whole (no probe)."""
    def due_policy():
        p = policy_with((1.0, 1.3), (0.0, 0.1), (0.5,))  # k = 1 pays only at an optimistic acceptance
        p.drafted, p.accepted = [40.0], [20.0]  # 40 rows at 0.5: optimistic (2 standard errors) ~0.64
        p.catch_up_s = 0.05
        p.batch_trace = [8] * 30  # the previous generate: 30 steps at 8 rows
        p.begin()
        p.steps_since_probe = EXPLORE_EVERY
        return p
    backlog = 8 * 10  # 10 prompt tokens per row: 4 s whole, 0.13 s a step over 30 steps
    assert due_policy().best_k(8, backlog) == 0
    assert due_policy().choose(8, backlog=lambda: backlog) == 1
    mid = due_policy()
    mid.first_step = False
    assert mid.choose(8, backlog=lambda: backlog) == 0


def test_acceptance_is_kept_per_batch_size_band_and_shrunk_toward_all_rows():
    """Rows drafted at the tail (2 rows, acceptance 0.2) do not set the full batch's estimate (32
    rows, 0.8): each band reads its own rows shrunk toward all rows' rate (direct formula), and
    an unseen band reads all rows' rate."""
    p = policy_with((1.0, 1.1), (0.0, 0.1), (0.5,), grid=(1, 2, 4, 8, 16, 32))
    for _ in range(20):
        p.observe(StepRecord(32, 1, 1e-3, 1, 1e-4, 58, [32], [26]))
    for i in range(200):
        p.observe(StepRecord(2, 1, 1e-3, 1, 1e-4, 2, [2], [int(i % 5 == 0) * 2]))
    drafted, accepted = p.band_counts[batch_band(32)]
    m = ACCEPT_BAND_PRIOR_ROWS
    assert p.acceptance_at(32)[0] == pytest.approx((accepted[0] + m * p.acceptance[0]) / (drafted[0] + m))
    assert p.acceptance[0] < 0.4 < 0.6 < p.acceptance_at(32)[0]
    assert p.acceptance_at(2)[0] < 0.3
    assert p.acceptance_at(6) == p.acceptance  # never drafted at 5-8 rows


def test_acceptance_is_the_row_weighted_rate_shrunk_toward_the_previous_position():
    p = policy_with((1.0, 1.1, 1.2), (0, 0.1, 0.2), (0.5, 0.5))
    p.begin()
    p.observe(StepRecord(100, 2, 1e-3, 2, 1e-4, 150, [100, 80], [80, 2]))
    p.observe(StepRecord(1, 2, 1e-3, 2, 1e-4, 3, [1, 1], [1, 1]))  # one lucky row
    m, keep = ACCEPT_PRIOR_ROWS, 1 - 1 / ACCEPT_WINDOW_ROWS  # counts forget per (effective) row drafted
    e100, e80 = 100 / (1 + 99 * ROW_CORRELATION), 80 / (1 + 79 * ROW_CORRELATION)  # one step's rows, correlated
    d1, a1 = e100 * keep + 1, 0.8 * e100 * keep + 1
    d2, a2 = e80 * keep + 1, (2 / 80) * e80 * keep + 1
    first = (a1 + m * ACCEPT_PRIOR) / (d1 + m)
    assert p.acceptance == pytest.approx([first, (a2 + m * first) / (d2 + m)])
    assert p.acceptance[0] < 0.75 and p.acceptance[1] < 0.4  # the lucky row weighs one row, not one step (0.9, 0.5)
    q = policy_with((1.0, 1.1, 1.2), (0, 0.1, 0.2), (0.5, 0.5))
    q.observe(StepRecord(100, 2, 1e-3, 2, 1e-4, 110, [100, 3], [10, 3]))  # position 2 seen in 3 rows only
    assert q.acceptance[1] < 0.5  # stays near position 1's 0.1, not 3 / 3


def test_rows_of_one_step_weigh_as_correlated_evidence():
    """n rows drafted in one step add n / (1 + (n - 1) * rho) rows of evidence (direct formula):
    one step of 32 rows at a hard spot (6 of 32) moves the estimate less than 32 independent
    rows would, and 32 one-row steps at the same rate move it further than that one step."""
    one_step = policy_with((1.0, 1.1), (0, 0.1), (0.5,))
    one_step.observe(StepRecord(32, 1, 1e-3, 1, 1e-4, 38, [32], [6]))
    e = 32 / (1 + 31 * ROW_CORRELATION)
    assert one_step.acceptance[0] == pytest.approx((6 / 32 * e + ACCEPT_PRIOR_ROWS * ACCEPT_PRIOR) / (e + ACCEPT_PRIOR_ROWS))
    independent = (6 + ACCEPT_PRIOR_ROWS * ACCEPT_PRIOR) / (32 + ACCEPT_PRIOR_ROWS)
    assert one_step.acceptance[0] > independent + 0.05
    spread = policy_with((1.0, 1.1), (0, 0.1), (0.5,))
    for i in range(32):
        spread.observe(StepRecord(1, 1, 1e-3, 1, 1e-4, 1, [1], [int(i % 16 < 3)]))  # 6 of 32, one row a step
    assert spread.acceptance[0] < one_step.acceptance[0] - 0.05


def test_a_one_row_tail_outweighs_the_prior_and_the_policy_drafts_what_pays():
    """Many one-row steps at conditional acceptance 0.7 / 0.25: the estimates approach those rates
    (direct formula of a ~ACCEPT_WINDOW_ROWS-row window plus the prior), and with costs where
    k = 1 pays more than k = 2 at those rates, the policy picks k = 1."""
    p = policy_with((2.0, 2.1, 2.1), (0.0, 0.6, 1.05), (0.5, 0.5))
    p.begin()
    for i in range(2000):  # deterministic patterns: 7 of 10 rows accept position 1, 1 of 4 of those position 2
        first = i % 10 < 7
        p.observe(StepRecord(1, 2, 2.1, 2, 1.05, 1, [1, int(first)], [int(first), int(first and i % 40 < 7)]))
    window, m = ACCEPT_WINDOW_ROWS, ACCEPT_PRIOR_ROWS
    assert p.acceptance[0] == pytest.approx(0.7, abs=0.05)
    want = (window * 0.25 + m * p.acceptance[0]) / (window + m)  # the window's rate shrunk by m prior rows
    assert p.acceptance[1] == pytest.approx(want, abs=0.05)
    rates = [p.rate(1, k) for k in range(3)]
    assert rates[1] > rates[2] > rates[0]  # at 0.7 / 0.25: 1.7 / 2.7 ms beats 1.875 / 3.15 ms
    assert p.best_k(1) == 1


def test_batch_grid_covers_the_engine_slots():
    assert batch_grid(1) == [1] and batch_grid(16) == [1, 2, 4, 8, 16] and batch_grid(100)[-1] == 100


def test_a_phase_profiled_as_free_does_not_skew_the_load_correction():
    t = CostTable([1, 4], {0: [0.0, 0.0], 1: [1.0, 2.0]})
    t.update(4, 0, 0.1)  # k = 0 drafting measured at a tenth of a millisecond: fine, no ratio to take
    assert t.correction == 1.0 and t.predict(4, 0) == 0.1 and t.predict(2, 1) == pytest.approx(4 / 3)


def test_profile_envelope_caps_each_point_by_every_point_doing_at_least_as_much_work():
    """Timing noise only adds, so a point is lowered to the cheapest point with >= rows and >= k
    (direct definition, brute force), and a profile that is already monotone is left alone."""
    import random

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


@pytest.mark.parametrize("length, slowdown", [(10, 2.5), (20, 1.8), (40, 1.5)])
def test_a_spell_of_interference_does_not_price_a_k_at_the_spells_cost_for_good(length, slowdown):
    """Interference comes in spells and slows every step alike. Steps cost their quiet time except
    during one spell, which starts while k = 1, the best quiet k, runs. Afterwards the policy must
    run k = 1 on most steps (a k measured in the spell is not kept at the spell's price until it
    happens to run again)."""
    verify, draft = (2.0, 2.1, 2.2, 2.3), (0.0, 0.6, 1.1, 1.6)
    acceptance = [0.7, 0.25, 0.1]
    best = max(range(4), key=lambda k: expected_tokens(acceptance, k) / (verify[k] + draft[k]))
    assert best == 1
    p = policy_with(verify, draft, acceptance)
    p.learn_acceptance = lambda drafted, accepted, batch_size: None  # acceptance fixed: the costs are under test
    p.begin()
    chosen = []
    for step in range(400):
        k = p.choose(1)
        slow = slowdown if 100 <= step < 100 + length else 1.0
        p.observe(StepRecord(1, k, verify[k] * slow, k, draft[k] * slow, 1, [], []))
        chosen.append(k)
    after = chosen[100 + length:]
    assert chosen[:100].count(best) > 90 and after.count(best) > 0.9 * len(after)


def test_a_switch_between_drafting_and_not_needs_a_clear_gain():
    """Rates by the direct formula, one row, no catch-up: verify 2.0 ms at k = 0 and 1, drafting
    0.5 ms, so k = 1 gives (1 + a) / 2.5 against 1 / 2.0 at k = 0."""
    def rate_ratio(a):  # k = 1 over k = 0
        return ((1 + a) / 2.5) / (1 / 2.0)

    assert 1 < rate_ratio(0.26) < 1 + SWITCH_MARGIN < rate_ratio(0.4)
    small = policy_with((2.0, 2.0), (0.0, 0.5), (0.26,))
    small.begin()
    assert small.best_k(1) == 1 and small.choose(1, backlog=lambda: 0) == 0  # 0.8 %: not worth a switch
    clear = policy_with((2.0, 2.0), (0.0, 0.5), (0.4,))
    clear.begin()
    assert clear.choose(1, backlog=lambda: 0) == 1  # 12 %: switches
    clear.acceptance = [0.235]
    assert 1 - SWITCH_MARGIN < rate_ratio(0.235) < 1
    assert clear.best_k(1) == 0 and clear.choose(1, backlog=lambda: 0) == 1  # 1.2 % worse: keeps drafting
    clear.acceptance = [0.1]
    assert rate_ratio(0.1) < 1 - SWITCH_MARGIN and clear.choose(1, backlog=lambda: 0) == 0  # 12 % worse: stops


def test_a_draft_measured_poor_is_not_probed_until_later_generates_make_the_evidence_old():
    """k = 1 pays from acceptance 0.3 here (verify 1.2 + draft 0.1 against 1.0). After 400 rows at
    1 in 8 accepted, even the optimistic acceptance cannot pay: no probe in 200 steps. The evidence
    shrinks at every generate on new weights (the trainer may have improved the draft): ten such
    generates later the draft is probed again."""
    p = policy_with((1.0, 1.2, 1.3), (0.0, 0.1, 0.2), (0.5, 0.5))
    p.begin()
    for _ in range(50):
        p.observe(StepRecord(8, 1, 1.2, 1, 0.1, 9, [8], [1]))
    assert p.acceptance[0] < 0.2 and p.optimistic_acceptance()[0] < 0.3
    assert [p.choose(8, backlog=lambda: 0) for _ in range(200)] == [0] * 200
    for _ in range(10):
        p.begin()  # same weights: the evidence stays
    assert p.optimistic_acceptance()[0] < 0.3
    for version in range(1, 11):
        p.begin(version)  # ten generates on new weights
    assert p.acceptance[0] > 0.4  # the estimate itself went back toward the prior (0.5)
    assert p.optimistic_acceptance()[0] > 0.3
    assert any(p.choose(8, backlog=lambda: 0) for _ in range(200))
