"""How many tokens to draft at each engine step: fixed, by batch-size schedule, or adaptive.

The engine asks its policy for k before each propose (`choose(batch_size)`) and reports what
the step cost and what got accepted (`observe`). k only changes how much is drafted, never how
drafts are verified, so every policy keeps the output exact.

  FixedK      k = num_speculative_tokens (vLLM's default behaviour).
  ScheduleK   vLLM's `num_speculative_tokens_per_batch_size`: inclusive batch-size ranges
              [(start, end, k), ...]; gaps and the tail carry the previous k; capped at
              num_speculative_tokens.
  AdaptiveK   vime's --spec-adaptive: k in {0..K} maximising expected tokens per second,
                  B * E(k) / (verify(B, 1+k) + draft(B, k)),
              E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j with a_j the conditional acceptance
              at draft position j (decayed counts of rows, one step's rows weighed as
              correlated evidence, see learn_acceptance and effective_rows; per batch-size
              band, shrunk toward all rows', see acceptance_at), and the step costs from a profile taken at the
              first generate (per batch size on a power-of-two grid, interpolated; made
              monotone in rows and tokens, since timing noise only adds) refined
              online by the measured times (an EMA per exact (B, k), and a
              measured/profiled correction per k and batch-size interval for the points
              not seen yet, see CostTable). Every
              EXPLORE_EVERY steps one step runs another k, round robin, among the k that
              could pay at this batch size at an optimistic acceptance (PROBE_Z standard
              errors above the estimate: a compute-bound batch, or a draft known to be poor,
              is not slowed down by probes) and an optimistic price for a k not measured
              at this batch size (CostTable.predict).
              Positions deferred by k = 0 steps (`backlog`) must be caught up by the
              first drafting step: seconds per position C, profiled and learnt from
              such steps. A switch to k > 0 is charged backlog * C spread over the steps
              left at this batch size (H(B): the previous generate's steps at <= B rows,
              the batch drains alike step after step in RL), a probe the whole of it, except
              at a generate's first step (only the prompts are deferred: their share).
              Without that, probes at 90-125 rows of a long-tail batch each cost
              ~25 ms of catch-up, and the policy lost 6-10 % to plain decoding.
              Costs are not learnt inside a spell of interference (in_spell), and a
              switch between drafting and not needs SWITCH_MARGIN more predicted
              tokens/s (sticky).
"""
import bisect
import math

# defaults of the adaptive policy, one source
ACCEPT_WINDOW_ROWS = 256  # the per-position row counts forget by (1 - 1 / this) per row drafted there
ACCEPT_PRIOR_ROWS = 8  # pseudo-rows of prior (the previous position's rate) in each estimate
ACCEPT_BAND_PRIOR_ROWS = 32  # pseudo-rows of the all-rows rate in a batch-size band's estimate
ROW_CORRELATION = 0.1  # of two rows' acceptance in one step: n rows weigh n / (1 + (n - 1) * this)
ACCEPT_KEEP_PER_LOAD = 0.5  # share of the row counts kept when a generate runs on new weights
PROBE_Z = 2.0  # a probe runs only if it could pay at this many standard errors above the acceptance
COST_EMA = 0.2  # weight of one step's measured time
ACCEPT_PRIOR = 0.5  # acceptance assumed before a position was ever drafted
PROFILE_REPEATS = 5  # best-of repeats per profiled point
CATCH_UP_PROFILE_ROWS = 8  # the catch-up profile: rows x deferred positions per row
CATCH_UP_PROFILE_POSITIONS = 32
LOAD_FAST, LOAD_SLOW = 0.3, 0.01  # EMA weights of measured / predicted step time (in_spell)
SPELL_RATIO = 1.2  # the fast ratio this far above the slow one: a spell of interference
SWITCH_MARGIN = 0.02  # predicted gain a switch between drafting and not must bring (sticky)
EXPLORE_EVERY = 40  # steps between one-off probes of another k (round robin), so costs and
#                     acceptance of the k not chosen stay measured (a draft that improves, a
#                     profile taken during a load spike)


class FixedK:
    """Always draft `k` (the proposer's num_speculative_tokens)."""

    observes = False  # the engine builds StepRecords only for policies that learn from them

    def __init__(self, k):
        self.k = k

    def choose(self, batch_size, backlog=None):
        """k for a step of batch_size rows. `backlog`: None or a callable giving the deferred
        positions a draft would catch up first (called only where drafting is considered: it
        walks the batch)."""
        return self.k

    def observe(self, step):
        pass

    def prepare(self, engine):
        pass

    def begin(self, weight_version=None):
        """A generate starts, with the engine's weights at `weight_version`."""

    def summary(self):
        return {}


class ScheduleK(FixedK):
    """vLLM's batch-size schedule, expanded to a dense lookup like vLLM does."""

    def __init__(self, schedule, k_max, max_batch_size):
        super().__init__(k_max)
        self.lookup = dense_schedule(schedule, k_max, max_batch_size)

    def choose(self, batch_size, backlog=None):
        return self.lookup[min(max(batch_size, 1), len(self.lookup) - 1)]


def dense_schedule(schedule, k_max, max_batch_size):
    """[0, k(1), ..., k(max_batch_size)] from validated sorted (start, end, k) ranges."""
    table = [0] * (max_batch_size + 1)
    for b in range(1, max_batch_size + 1):
        current = None
        for start, end, k in schedule:
            if start <= b:
                current = k  # inside this range, or in the gap / tail after it
            if start <= b <= end:
                break
        table[b] = min(k_max, current)
    return table


class StepRecord:
    """What one engine step did: batch size, k verified / drafted, times, acceptance per position,
    and how many deferred positions its drafting caught up first."""

    def __init__(self, batch_size, k_verified, verify_s, k_drafted, draft_s, emitted, drafted_per_pos,
                 accepted_per_pos, caught_up=0):
        self.batch_size, self.k_verified, self.verify_s = batch_size, k_verified, verify_s
        self.k_drafted, self.draft_s, self.emitted = k_drafted, draft_s, emitted
        self.drafted_per_pos, self.accepted_per_pos = drafted_per_pos, accepted_per_pos
        self.caught_up = caught_up


class Forecast:
    """One step's prediction at batch size b: tokens per row and seconds, per k."""

    def __init__(self, b, tokens, seconds):
        self.b, self.tokens, self.seconds = b, tokens, seconds

    def rate(self, k, extra_s=0.0):
        """Tokens per second with k drafts (plus extra_s seconds)."""
        return self.b * self.tokens[k] / max(self.seconds[k] + extra_s, 1e-9)


class CostTable:
    """Seconds of one step phase (verify or draft) against batch size B and k.

    A point measured at its exact (B, k) is predicted by its EMA. Any other is the profile times
    a measured/profiled correction for k in B's grid interval; where k was never measured in
    that interval, the larger of k's correction elsewhere and k = 0's in the interval (a step
    with drafts costs at least what the profile misses at k = 0 there). Why not one factor: the
    profile (dummy tokens, contiguous slots, no verification or bookkeeping) misses costs that
    grow with k and with B. On the long-tail tiny model real steps took 1.26x their profile at
    k = 0 but 1.70x at k = 1 (a shared factor priced drafting ~35 % too cheap), and a factor per
    k learnt at the few rows where drafting runs priced k = 1 at 64 rows below its k = 0 steps
    there (1.57x against 1.83x), so the policy drafted 1 token at 0.17 acceptance."""

    def __init__(self, grid, profiled):
        self.grid = grid  # sorted batch sizes
        self.profiled = profiled  # {k: [seconds per grid batch size]}
        self.measured = {}  # (B, k) -> EMA seconds
        self.correction = 1.0  # EMA of measured / profiled over every k and B
        self.ratios = {}  # (k, grid interval) and k -> (EMA of measured / profiled, observations)
        self.profile_memo = {}  # (b, k) -> profile_at(b, k): the profile never changes, and this runs every step

    def profile_at(self, b, k):
        seconds = self.profile_memo.get((b, k))
        if seconds is None:
            seconds = self.profile_memo[(b, k)] = self.interpolate(b, k)
        return seconds

    def interpolate(self, b, k):
        ys = self.profiled[k]
        i = bisect.bisect_left(self.grid, b)
        if i == 0:
            return ys[0] * b / self.grid[0]
        if i == len(self.grid):  # past the grid: grow linearly from the last two points
            i = len(self.grid) - 1
        x0, x1, y0, y1 = self.grid[i - 1], self.grid[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (b - x0) / (x1 - x0)

    def interval(self, b):
        return bisect.bisect_left(self.grid, b)

    def predict(self, b, k, optimistic=False):
        """Seconds at (b, k). optimistic: where k was never measured in b's interval, what a probe
        might still find there: the profile plus only the seconds it misses at k = 0 there (the
        bookkeeping of a step, which drafting does not multiply). Why not k = 0's ratio: applied
        to k's larger profile it multiplies that fixed miss too; at 32 rows it priced k = 1 at
        6.3 ms where it costs 5.8, and no probe ever found out."""
        if (b, k) in self.measured:
            return self.measured[(b, k)]
        here = self.ratios.get((k, self.interval(b)))
        if here is not None:
            return here[0] * self.profile_at(b, k)
        elsewhere, plain_here = self.ratios.get(k), self.ratios.get((0, self.interval(b)))
        if optimistic and plain_here is not None:
            return self.profile_at(b, k) + max(0.0, plain_here[0] - 1) * self.profile_at(b, 0)
        ratios = [entry[0] for entry in (elsewhere, plain_here) if entry is not None]
        return (max(ratios) if ratios else self.correction) * self.profile_at(b, k)

    def update(self, b, k, seconds):
        old = self.measured.get((b, k))
        self.measured[(b, k)] = seconds if old is None else (1 - COST_EMA) * old + COST_EMA * seconds
        profiled = self.profile_at(b, k)
        if profiled > 0:  # a phase profiled as free (no drafting at k = 0) says nothing about load
            ratio = seconds / profiled
            self.correction = (1 - COST_EMA) * self.correction + COST_EMA * ratio
            for key in (k, (k, self.interval(b))):
                factor, n = self.ratios.get(key, (ratio, 0))
                w = max(COST_EMA, 1.0 / (n + 1))  # a running mean, then an EMA
                self.ratios[key] = ((1 - w) * factor + w * ratio, n + 1)


def expected_tokens(acceptance, k):
    """Tokens one verify emits per row with k drafts: 1 + sum_i prod_{j<=i} a_j."""
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total


class AdaptiveK(FixedK):
    """k maximising expected tokens/s from measured costs and live acceptance (see module doc)."""

    observes = True

    def __init__(self, k_max):
        super().__init__(k_max)
        self.acceptance = [ACCEPT_PRIOR] * k_max
        self.drafted, self.accepted = [0.0] * k_max, [0.0] * k_max  # decayed row counts per position
        self.band_counts = {}  # batch_band -> its own (drafted, accepted) decayed row counts
        self.verify, self.draft = None, None
        self.catch_up_s = 0.0  # seconds to catch up one deferred position (profiled, then learnt)
        self.batch_trace, self.previous_batches = [], []  # batch sizes of this / the previous generate
        self.steps_since_probe, self.next_probe = 0, 0
        self.load_fast = self.load_slow = 1.0  # measured / predicted step time, fast and slow EMAs
        self.drafting = False  # whether the last step drafted (see sticky)
        self.weight_version = None  # of the last generate (begin)
        self.begin()

    # ------------------------------------------------------------ profile
    def prepare(self, engine):
        """Profile verify(B, 1+k) and draft(B, k) once, on the engine's own forward passes."""
        if self.verify is not None:
            return
        grid = batch_grid(engine.config.max_batch_size)
        ks = range(self.k + 1)
        verify = {k: [engine.profile_verify(b, 1 + k, repeats=PROFILE_REPEATS) for b in grid] for k in ks}
        draft = {k: [engine.profile_draft(b, k, repeats=PROFILE_REPEATS) for b in grid] for k in ks}
        self.verify = CostTable(grid, monotone_envelope(verify))
        self.draft = CostTable(grid, monotone_envelope(draft))
        if self.k:
            self.catch_up_s = profile_catch_up(engine, min(CATCH_UP_PROFILE_ROWS, engine.config.max_batch_size))

    # ------------------------------------------------------------ choice
    def forecast(self, b):
        """Every k's predicted tokens and seconds for one step at batch size b."""
        acceptance = self.acceptance_at(b)
        return Forecast(b, [expected_tokens(acceptance, k) for k in range(self.k + 1)],
                        [self.step_time(b, k) for k in range(self.k + 1)])

    def rate(self, b, k, extra_s=0.0):
        """Predicted tokens per second with k drafts at batch size b (plus extra_s seconds)."""
        return self.forecast(b).rate(k, extra_s)

    def step_time(self, b, k, optimistic=False):
        return self.verify.predict(b, k, optimistic) + self.draft.predict(b, k, optimistic)

    def horizon(self, b):
        """Steps expected at <= b rows from here: the previous generate's (at least 1)."""
        return max(1, bisect.bisect_right(self.previous_batches, b))

    def catch_up_share(self, b, k, backlog, whole=False):
        """Seconds charged to one k-draft step for catching up `backlog` deferred positions: the
        whole catch-up spread over the steps left at this batch size (or, if `whole`, all of it)."""
        if not (k and backlog):
            return 0.0
        return backlog * self.catch_up_s / (1 if whole else self.horizon(b))

    def best_k(self, b, backlog=0, forecast=None):
        forecast = forecast or self.forecast(b)
        rates = [forecast.rate(k, self.catch_up_share(b, k, backlog)) for k in range(self.k + 1)]
        return max(range(self.k + 1), key=lambda k: (rates[k], -k))

    def could_pay(self, b, k, than_k, backlog=0, whole_catch_up=True, forecast=None):
        """Would k beat k' = than_k at batch size b at the optimistic acceptance and costs, paying for
        the whole catch-up of `backlog` deferred positions (a probe may be a single drafting step),
        or, if not whole_catch_up, its share (see choose)?"""
        catch_up = self.catch_up_share(b, k, backlog, whole=whole_catch_up)
        best = (forecast or self.forecast(b)).rate(than_k, self.catch_up_share(b, than_k, backlog))
        tokens = expected_tokens(self.optimistic_acceptance(b), k)
        return b * tokens / max(self.step_time(b, k, optimistic=True) + catch_up, 1e-9) > best

    def optimistic_acceptance(self, b=None):
        """Per position, the acceptance PROBE_Z standard errors above its estimate at batch size b:
        what a probe might still find. The standard error counts the band's own rows plus its
        prior rows where the band was drafted, else all rows plus theirs. Why not every draft
        accepted: a draft measured at 0.2 over hundreds of rows was probed at k = 3 every 40 steps,
        each probe at 9-32 rows with its catch-up costing 2-3 plain steps (5 % of the long-tail
        rollout with a stale draft). Counts shrink at every generate on new weights (begin), so a
        draft the trainer improved gets probed again."""
        out = []
        band = None if b is None else self.band_counts.get(batch_band(b))
        estimate, evidence = (self.acceptance, self.drafted) if band is None else (self.acceptance_at(b), band[0])
        prior_rows = ACCEPT_PRIOR_ROWS if band is None else ACCEPT_BAND_PRIOR_ROWS
        for a, n in zip(estimate, evidence):
            rows = n + prior_rows
            out.append(min(1.0, a + PROBE_Z * math.sqrt(max(a * (1 - a), 1 / rows) / rows)))
        return out

    def sticky(self, b, k, backlog, forecast=None):
        """k, unless it switches between drafting and not for less than SWITCH_MARGIN more predicted
        tokens/s: then the best k on the current side. Why: a switch to drafting pays the catch-up
        of every deferred position, which is repaid only if drafting goes on; where drafting and
        not are about equal, estimates within their noise flipped the choice back and forth, and
        each return to drafting paid another catch-up (5-10 % of a 32-row generate lost to k = 0,
        where fixed k = 1 gained 4 %). A wider margin kept k = 0 where k = 1 paid 5-7 %."""
        if (k > 0) == self.drafting:
            return k
        f = forecast or self.forecast(b)
        if self.drafting:  # keep drafting unless not drafting is clearly better
            best_drafting = max(range(1, self.k + 1), key=f.rate)
            return k if f.rate(0) > (1 + SWITCH_MARGIN) * f.rate(best_drafting) else best_drafting
        switch_pays = f.rate(k, self.catch_up_share(b, k, backlog)) > (1 + SWITCH_MARGIN) * f.rate(0)
        return k if switch_pays else 0

    def probe_k(self, b, best, backlog=0, whole_catch_up=True, forecast=None):
        """The next k to probe, round robin over the others that could pay; None if none can."""
        for step in range(1, self.k + 1):
            k = (self.next_probe + step) % (self.k + 1)
            if k != best and self.could_pay(b, k, best, backlog, whole_catch_up, forecast):
                self.next_probe = k
                return k
        return None

    def choose(self, batch_size, backlog=None):
        forecast = self.last_forecast = self.forecast(batch_size)  # nothing is learnt before the step: one serves
        k = self.best_k(batch_size, forecast=forecast)
        self.steps_since_probe += 1
        probe_due = self.k and self.steps_since_probe >= EXPLORE_EVERY
        deferred = backlog() if backlog is not None and (k or probe_due) else 0
        if k and deferred:  # a catch-up only lowers the rates of k > 0: k = 0 stays best without it
            k = self.best_k(batch_size, deferred, forecast)
        k = self.sticky(batch_size, k, deferred, forecast)
        if probe_due:
            # At a generate's first step nothing is deferred but the prompts, whose draft-layer pass
            # every drafting step of this generate needs; a probe there that drafting then keeps
            # (sticky) pays them once over the steps ahead, so it is charged their share. Mid-
            # generate, a probe pays the whole catch-up (and is rarely worth it on a big batch):
            # 40 steps into a 32-row generate that is ~1300 positions, so no probe ran there and
            # k = 0 was kept where k = 1 paid 3-5 %.
            probe = self.probe_k(batch_size, k, deferred, not self.first_step, forecast)
            if probe is not None:  # else stay due: a later, smaller batch may be worth a probe
                k, self.steps_since_probe = probe, 0
        self.batch_trace.append(batch_size)
        self.first_step = False
        self.drafting = k > 0
        self.trace["k_rows"] += k * batch_size
        self.trace["rows"] += batch_size
        return k

    # ------------------------------------------------------------ learning
    def observe(self, step):
        b = step.batch_size
        # the prediction this step is traced against is the one made before it (choose's, when the
        # rows it verified are the rows it was chosen for)
        ahead = self.last_forecast if self.last_forecast is not None and self.last_forecast.b == b else self.forecast(b)
        # a catch-up is priced least well of all steps (and is rare): it neither reads nor feeds the
        # spell test
        if step.caught_up or not self.in_spell(step):
            self.learn_costs(step)
        self.learn_acceptance(step.drafted_per_pos, step.accepted_per_pos, b)
        k = step.k_verified
        self.trace["plain_s_pred"] += step.emitted * ahead.seconds[0] / b
        self.trace["measured_s"] += step.verify_s + (step.draft_s or 0.0)
        self.trace["pred_tokens"] += b * ahead.tokens[k]
        self.trace["pred_s"] += ahead.seconds[k]
        self.trace["emitted"] += step.emitted

    def in_spell(self, step):
        """Is the machine inside a spell of interference? Measured over predicted step time, a fast
        EMA against a slow one: other work comes in spells that slow every step alike, whatever k
        runs, so a spell shows as the fast ratio SPELL_RATIO above the slow one. Costs are not
        learnt there (acceptance is): a k measured in a spell kept the spell's price after it,
        until it ran again, and a 10-step spell at 2.5x once left the best k unpriced for good.
        Not learning a spell loses nothing: it slows every k alike, so the k chosen is the same."""
        b, kd = step.batch_size, step.k_drafted
        predicted = self.verify.predict(b, step.k_verified) + (self.draft.predict(b, kd) if kd is not None else 0.0)
        ratio = (step.verify_s + (step.draft_s or 0.0)) / max(predicted, 1e-12)
        self.load_fast += LOAD_FAST * (ratio - self.load_fast)
        self.load_slow += LOAD_SLOW * (ratio - self.load_slow)
        return self.load_fast > SPELL_RATIO * self.load_slow

    def learn_costs(self, step):
        """Update the cost tables and the catch-up price from one step's times."""
        b = step.batch_size
        self.verify.update(b, step.k_verified, step.verify_s)
        if step.k_drafted is not None and step.caught_up:
            # what this drafting took beyond drafting k, per position caught up
            extra = max(0.0, step.draft_s - self.draft.predict(b, step.k_drafted)) / step.caught_up
            self.catch_up_s = (1 - COST_EMA) * self.catch_up_s + COST_EMA * extra
        elif step.k_drafted is not None:
            self.draft.update(b, step.k_drafted, step.draft_s)

    def learn_acceptance(self, drafted_per_pos, accepted_per_pos, batch_size=None):
        """Per position, decayed counts of rows drafted and accepted, read with ACCEPT_PRIOR_ROWS
        pseudo-rows at the previous position's rate (ACCEPT_PRIOR at the first): rows, not steps,
        carry the weight, and a deep position seen in a handful of rows stays near the shallower
        one. (Step-weighted means once read a stale draft's 0.004 conditional acceptance at
        position 2 as 0.33 from three one-row steps, so k = 3 looked worth drafting.)

        The counts forget per row drafted (a window of ~ACCEPT_WINDOW_ROWS rows), not per step:
        the estimate follows a draft that changes at any batch size, and a one-row tail keeps
        enough evidence to outweigh the prior. (Decaying by a tenth per step left ~10 rows at one
        row per step; the 8 pseudo-rows then read position 2's 0.25 as 0.45, and the policy drafted
        2 tokens where 1 paid 15 % more.)

        The same counts are kept for batch_size's band (see acceptance_at)."""
        add_decayed_rows(self.drafted, self.accepted, drafted_per_pos, accepted_per_pos)
        if batch_size is not None and any(drafted_per_pos):
            band = self.band_counts.setdefault(batch_band(batch_size), ([0.0] * self.k, [0.0] * self.k))
            add_decayed_rows(*band, drafted_per_pos, accepted_per_pos)
        self.estimate_acceptance()

    def acceptance_at(self, b):
        """Per position, the rate of the rows drafted at batch sizes in b's band, shrunk toward all
        rows' rate by ACCEPT_BAND_PRIOR_ROWS pseudo-rows. Why per band: in an RL rollout the rows
        left at the tail are the long, hard responses, and their drafts are accepted less (0.52
        against 0.72 on the long-tail task): read as one rate, a tail's rows set the estimate
        the next generate's full batch starts from (0.71 at 32 rows fell to 0.57-0.61), and the
        policy left drafting off at 32 rows where k = 1 paid 3-5 %."""
        counts = self.band_counts.get(batch_band(b))
        if counts is None:
            return self.acceptance
        m = ACCEPT_BAND_PRIOR_ROWS
        return [(a + m * prior) / (d + m) for d, a, prior in zip(*counts, self.acceptance)]

    def estimate_acceptance(self):
        """Each position's rate from its counts and ACCEPT_PRIOR_ROWS rows at the previous one's."""
        prior = ACCEPT_PRIOR
        for i in range(self.k):
            if self.drafted[i]:
                self.acceptance[i] = (self.accepted[i] + ACCEPT_PRIOR_ROWS * prior) / (self.drafted[i] + ACCEPT_PRIOR_ROWS)
            prior = self.acceptance[i]

    def begin(self, weight_version=None):
        """Start the per-generate summary; the batch sizes of the generate before set the horizon."""
        if self.batch_trace:
            self.previous_batches, self.batch_trace = sorted(self.batch_trace), []
        if weight_version != self.weight_version:  # the draft may have changed: its evidence counts less
            self.weight_version = weight_version
            for counts in (self.drafted, self.accepted, *(c for band in self.band_counts.values() for c in band)):
                counts[:] = [n * ACCEPT_KEEP_PER_LOAD for n in counts]
            self.estimate_acceptance()  # toward the prior as the evidence shrinks
        self.drafting = False  # a generate starts with every prompt to catch up
        self.last_forecast = None
        self.first_step = True
        self.trace = dict.fromkeys(("k_rows", "rows", "plain_s_pred", "measured_s", "pred_tokens", "pred_s",
                                    "emitted"), 0.0)

    def summary(self):
        """spec_k_mean (row-weighted) and predicted vs measured speedup over plain decoding."""
        t = self.trace
        if not t["rows"] or not t["measured_s"] or not t["pred_s"]:
            return {}
        plain_rate = t["emitted"] / max(t["plain_s_pred"], 1e-12)  # predicted plain tokens/s here
        return {"spec_k_mean": t["k_rows"] / t["rows"],
                "spec_predicted_speedup": (t["pred_tokens"] / t["pred_s"]) / plain_rate,
                "spec_measured_speedup": (t["emitted"] / t["measured_s"]) / plain_rate}


def add_decayed_rows(drafted, accepted, drafted_per_pos, accepted_per_pos):
    """Add one step's rows to per-position counts that forget by (1 - 1 / ACCEPT_WINDOW_ROWS) per row,
    the step's n rows at the weight of effective_rows(n) independent ones."""
    keep_per_row = 1 - 1 / ACCEPT_WINDOW_ROWS
    for i, (d, a) in enumerate(zip(drafted_per_pos, accepted_per_pos)):
        if d and i < len(drafted):
            rows = effective_rows(d)
            keep = keep_per_row ** rows
            drafted[i] = keep * drafted[i] + rows
            accepted[i] = keep * accepted[i] + a * rows / d


def effective_rows(n):
    """What n rows drafted in one step weigh as evidence of the acceptance rate. Why not n: rows
    decoded together are at the same point of similar responses (an RL group shares its prompt,
    a batch starts together), and acceptance swings with that point (at 32 rows, from 31 of 32
    to 10 of 32 accepted between steps of one generate). One probe step read 6 of 32 at a hard
    spot, and as 32 independent rows it set the estimate there for good (0.19 where the rate
    is 0.7), so drafting was never tried again where it paid."""
    return n / (1 + (n - 1) * ROW_CORRELATION)


def batch_band(b):
    """Batch sizes grouped 1, 2, 3-4, 5-8, 9-16, ...: the cost profile's grid intervals (batch_grid),
    and the groups acceptance is kept by (the drain's stragglers draft unlike its full batch)."""
    return (b - 1).bit_length()


def monotone_envelope(profiled):
    """{k: [seconds per grid batch size]} lowered so cost never falls with more rows or more tokens.

    Interference from other work only ever adds time to a measurement, so where a point costs
    more than one doing strictly more work (more tokens at the same batch size, or more rows at
    the same k), the point is the outlier: it is capped by every point above it. (A noisy
    profile once priced verifying 2 tokens above verifying 3, and the policy drafted 2-3 tokens
    where 1 paid best.)"""
    ks = sorted(profiled)
    out = {k: list(profiled[k]) for k in ks}
    for i in reversed(range(len(ks) - 1)):  # suffix-min over k
        out[ks[i]] = [min(a, b) for a, b in zip(out[ks[i]], out[ks[i + 1]])]
    for k in ks:  # suffix-min over the batch grid
        ys = out[k]
        for j in reversed(range(len(ys) - 1)):
            ys[j] = min(ys[j], ys[j + 1])
    return out


def profile_catch_up(engine, rows, deferred=CATCH_UP_PROFILE_POSITIONS):
    """Seconds per position of catching up `deferred` positions per row (the drafting step
    with that many new positions, less one with the usual two, per extra position)."""
    deferred = max(1, min(deferred, engine.max_len // 2))  # a short context holds fewer
    long = engine.profile_draft(rows, 1, repeats=PROFILE_REPEATS, new_tokens=2 + deferred)
    short = engine.profile_draft(rows, 1, repeats=PROFILE_REPEATS, new_tokens=2)
    return max(0.0, long - short) / (rows * deferred)


def batch_grid(max_batch_size):
    """1, 2, 4, ... up to and including max_batch_size."""
    grid = [2 ** i for i in range(int(math.log2(max_batch_size)) + 1)]
    return grid if grid[-1] == max_batch_size else grid + [max_batch_size]


def build_k_policy(spec, adaptive, max_batch_size):
    """The policy for a SpecConfig (None: no speculation) and the --spec-adaptive flag."""
    if spec is None:
        return FixedK(0)
    if adaptive:
        return AdaptiveK(spec.num_speculative_tokens)
    if spec.num_speculative_tokens_per_batch_size is not None:
        return ScheduleK(spec.num_speculative_tokens_per_batch_size, spec.num_speculative_tokens, max_batch_size)
    return FixedK(spec.num_speculative_tokens)
