"""How many tokens to draft at each engine step: fixed, by batch-size schedule, or adaptive.

The engine asks its policy for k before each step (`choose(batch_size)`) and, if the policy
observes, reports what the step did (`observe`). k only changes how much is drafted, never how
drafts are verified, so every policy keeps the output exact.

  FixedK      k = num_speculative_tokens (vLLM's default behaviour).
  ScheduleK   vLLM's `num_speculative_tokens_per_batch_size`: inclusive batch-size ranges
              [(start, end, k), ...]; gaps and the tail carry the previous k; capped at
              num_speculative_tokens.
  AdaptiveK   vime's --spec-adaptive: the same kind of schedule, written at the start of every
              generate (`begin`) as k(B) = argmax_k B E(k) / (verify(B, 1+k) + draft(B, k)):
              E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j (expected_tokens), a_j the acceptance at draft
              position j given the one before (rows accepted over rows that reached it, all steps
              so far, plus ACCEPT_PRIOR_ROWS rows at the previous position's rate); the step costs
              from a profile of the engine's own passes at its first generate (power-of-two
              batch grid, linear in between, monotone_envelope), each k's scaled by what real
              k-draft steps took over what the profile priced them at (cost_correction); that
              evidence decays at each generate, and a k not run again is priced as the others
              once its evidence is worth less than one 1-row step (COST_FORGET_STEPS), so one slow
              generate (a cold start, a burst of load) does not price a k out for good. A batch only drains within a
              generate, so k changes at a few batch sizes. At each generate on new weights the
              counts shrink (ACCEPT_KEEP_PER_LOAD): the estimate of a draft no longer drafted
              drifts back to the prior until drafting is tried again where that would pay.
              A proposer that works at every step (DFlash writes each verified position into its
              draft's context) has that work in the k = 0 price too: priced as plain decoding,
              a step without drafts would look cheaper than it is, and a block, whose forward
              costs the same for any k, would never be drafted, so never measured.
              Not priced: the one catch-up of draft positions deferred by k = 0 steps at a switch
              to drafting (a draft-layer pass, a fraction of what the trunk spent on them).
  ConfidenceSizedK  vLLM's enable_adaptive_verification: at each batch size the block or nothing is
              drafted: where the two were compared inside one generate (PairedEvidence: at a batch bucket
              that emitted PAIR_MIN_STEPS tokens a row, a generate runs PAIR_RUN_STEPS steps of plain
              decoding, then the block, about once in ten generates, and again at the next generate where
              its verdict differs from the last one there, until two agree), by the ratio of their rates there,
              both measured under the machine's speed of the same moments; else where real plain steps
              and block steps were both measured there (the schedule
              chose each at some generate), by their measured tokens per second (OptionRates; at a
              bucket a batch drains through, a step or two a generate, from one step of each), an
              option no longer run there keeping its last rate (the block's scaled by its expected
              tokens now over then) for RATE_KEEP_GENERATES generates after its last step there (at each
              retry that rules it out again doubled, or longer where its loss asks, up to
              RATE_KEEP_MAX_GENERATES), the first generate not measured (first calls); where only one option
              was measured, the other is tried (unless a generate within that wait ran it there without a
              step of it measured); else
              by their prices, the block priced as its steps will be sized (best_k);
              DRAFT_MARGIN in plain decoding's favour either way. (Mixing the two at every generate
              was dearer than it told: a drafting step after plain ones catches up their context,
              and its first draft was accepted less, 0.85 against 0.91 with every 4th step plain;
              hence runs of several steps, and only where the paired evidence is stale.) Rows that drain
              from a plain bucket into drafting ones catch up their draft context there once, for every
              position since admission: a run of drafting buckets entered so drafts only where that
              catch-up, priced per position as measured, costs less than drafting saved there in the last
              generate (price_switches).
              Once a block is drafted the step verifies q drafts, rate(q) =
              (B + sum_rows sum_{j<q} s_j) / (verify(B, 1+q) + draft(B, k)) being the expected tokens per
              second, s_j the running product of the draft's per-slot confidences (the chance draft j is
              still accepted), the draft already paid. The verify and the draft are each priced at the
              profile's seconds plus what real steps' parts took beyond it near that batch size,
              pooled over every q and k (CostEvidence): the engine's host work around a forward,
              which the profile's probes do not do. q grows while one more draft raises rate(q) (the
              argmax where rate is unimodal): whether draft j is verified then depends on s_0..s_j,
              which depend on the drafts before j only, never on draft j itself. That is what keeps
              sampled drafts exact: a draft verified or not according to its own value would be
              verified as drawn from a distribution other than its q. vLLM ranks single draft slots
              because its verify costs per token; this engine's verify pads every row to the longest,
              so its price depends on q alone. The schedule's acceptance counts the verified drafts'
              outcomes and, for the drafts a step leaves unverified, what their confidence expects;
              it starts at 1 (every draft passes) where AdaptiveK starts at 1/2, so that blocks get
              drafted and their confidences seen: a block the profile prices above 1 + 1/2 + 1/4 + ...
              tokens was otherwise never drafted, its acceptance never known.
"""
import math

ACCEPT_PRIOR = 0.5  # acceptance assumed before a position was ever drafted
ACCEPT_PRIOR_ROWS = 8  # pseudo-rows of prior (the previous position's rate) in each estimate
ACCEPT_KEEP_PER_LOAD = 0.5  # share of the row counts kept when a generate runs on new weights
COST_KEEP_PER_GENERATE = 0.5  # share of the measured/profiled step seconds kept at each generate
COST_FORGET_STEPS = 1.0  # a k's measured/profiled evidence below this many 1-row steps is dropped
PROFILE_REPEATS = 5  # best-of repeats per profiled point
# a sized schedule drafts its block only where it is measured (or priced) this much faster than plain
# decoding: the steps it rates leave out what drafting costs the steps after them (the rows' lengths drift
# apart and every later step's attention pads to the longest) and the draft cache's moves as rows finish;
# at 128 rows the block's steps measured 1.02-1.08x plain decoding's inside one generate while whole
# generates drafting it there ran at 0.95-0.98x (0.10 left the block undrafted at 32 rows in half the runs,
# where it paid 1.11x)
DRAFT_MARGIN = 0.08
# steps of plain decoding and of the block (verify and draft parts each, decayed like the cost evidence)
# a batch bucket needs before their measured rates decide there (OptionRates)
RATE_STEPS = 4.0
# ... at a bucket the ending generate ran fewer than RATE_STEPS steps at (one a batch drains through): evidence
# decayed by COST_KEEP_PER_GENERATE holds at most twice the steps a generate runs there, so RATE_STEPS is never
# reached and a rate from this many steps of each part decides instead
THIN_RATE_STEPS = 1.0
# generates an option's last measured rate at a batch bucket stands once the option no longer runs there
# (its steps' rate expired): the ruled-out option is then tried again about once in this many generates;
# each retry that rules it out again doubles that, or waits long enough that its loss there comes to RETRY_SHARE of
# the generates it waits, whichever is longer, up to RATE_KEEP_MAX_GENERATES
RATE_KEEP_GENERATES = 8
RATE_KEEP_MAX_GENERATES = 32
RETRY_SHARE = 0.01
# paired comparison (ConfidenceSizedK): at a batch bucket where the last generate emitted PAIR_MIN_STEPS tokens a
# row and the paired evidence is worth less than PAIR_STALE generates, the next generate runs PAIR_RUN_STEPS steps
# of plain decoding there, then the block (and so does the generate after a comparison whose verdict differs
# from the last one there); the two rates of that one generate give one ratio, whose evidence is kept
# PAIR_KEEP_PER_GENERATE at each generate and decides there while worth PAIR_FORGET
PAIR_RUN_STEPS = 3
PAIR_MIN_STEPS = 4 * PAIR_RUN_STEPS  # room for the plain run and the block's steps after it in a bucket that shrinks
# steps of each part a compared option needs in its generate: rates of steps moments apart share the machine's
# speed, so fewer steps than RATE_STEPS (rates of different generates) give a steady ratio
PAIR_RATE_STEPS = 2.0
PAIR_KEEP_PER_GENERATE = 0.9
PAIR_STALE = 0.35  # one comparison's weight falls below this after 10 generates: compared again then
PAIR_FORGET = 0.1
PAIR_STALE_AFTER = math.ceil(math.log(PAIR_STALE) / math.log(PAIR_KEEP_PER_GENERATE))  # generates: 10
# where the paired evidence has the block losing, a comparison waits until its loss there comes to RETRY_SHARE of
# the generates since the last (as a retry does), up to this many generates beyond PAIR_STALE_AFTER: then the
# evidence is still worth PAIR_FORGET at the generate that compares (PAIR_STALE * 0.9 ** 10 = 0.12 > 0.1 / 0.9)
PAIR_LOSING_EXTRA_MAX = 10


class FixedK:
    """Always draft `k` (the proposer's num_speculative_tokens)."""

    observes = False  # the engine builds StepRecords only for policies that learn from them
    # whether verification_size may verify fewer drafts than drafted: a proposer computes the confidences that
    # size a step only for a policy that reads them
    sizes_verification = False

    def __init__(self, k):
        self.k = k

    def choose(self, batch_size):
        """k for a step of batch_size rows."""
        return self.k

    def observe(self, step):
        pass

    def observe_prefill(self, batch_size, k, seconds):
        """The proposer's work after a prefill (its context for the admitted prompts, its first drafts)
        took `seconds`, at batch_size rows with k chosen."""

    def verification_size(self, batch_size, survival):
        """How many drafts a step verifies given each row's survival [B, k]: one count for every row, or
        one per row (None: every one drafted). Whether draft j is verified may depend on survival up to
        j only (which the drafts before j decide), or sampled drafts stop being exact."""
        return None

    def prepare(self, engine):
        pass

    def begin(self, weight_version=None):
        """A generate starts, with the engine's weights at `weight_version`."""

    def drafts_this_generate(self):
        """Whether any step of the generate begun may draft (asked once a generate, after `begin`)."""
        return self.k > 0

    def summary(self):
        return {}


class ScheduleK(FixedK):
    """vLLM's batch-size schedule, expanded to a dense lookup like vLLM does."""

    def __init__(self, schedule, k_max, max_batch_size):
        super().__init__(k_max)
        self.lookup = dense_schedule(schedule, k_max, max_batch_size)

    def choose(self, batch_size):
        return self.lookup[min(max(batch_size, 1), len(self.lookup) - 1)]

    def drafts_this_generate(self):
        return any(self.lookup[1:])


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
    """What one engine step did: batch size, k verified / drafted, times, and per draft position the
    rows that reached it and the rows that accepted it; the rows' cached positions before it (context),
    and the draft context its drafting caught up for earlier steps without drafts (positions, seconds)."""

    def __init__(self, batch_size, k_verified, verify_s, k_drafted, draft_s, emitted, drafted_per_pos,
                 accepted_per_pos, context=0, caught_up=(0, 0.0)):
        self.batch_size, self.k_verified, self.verify_s = batch_size, k_verified, verify_s
        self.k_drafted, self.draft_s, self.emitted = k_drafted, draft_s, emitted
        self.drafted_per_pos, self.accepted_per_pos = drafted_per_pos, accepted_per_pos
        self.context, self.caught_up = context, caught_up


def expected_tokens(acceptance, k):
    """Tokens one verify emits per row with k drafts: 1 + sum_i prod_{j<=i} a_j."""
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total


class AdaptiveK(ScheduleK):
    """A per-batch-size schedule maximising expected tokens/s, rewritten at every generate from a
    start-up cost profile and the live acceptance estimate (see module doc)."""

    observes = True
    corrects_costs = True  # False: the profile is the whole price (one made for another machine)
    accept_prior = ACCEPT_PRIOR

    def __init__(self, k_max):
        FixedK.__init__(self, k_max)
        self.drafted, self.accepted = [0.0] * k_max, [0.0] * k_max  # row counts per draft position
        self.costs = None  # [None, [seconds of a step at B rows with k drafts, k = 0..K] for B = 1..]
        # per k, decayed sums of the seconds real steps took and of what the profile priced them at
        self.measured_s, self.profiled_s = [0.0] * (k_max + 1), [0.0] * (k_max + 1)
        self.lookup = [k_max, k_max]  # until a profile exists (prepare)
        self.weight_version = None  # of the last generate (begin)
        self.tokens = [expected_tokens(self.acceptance(), k) for k in range(k_max + 1)]
        self.trace = new_trace()

    def prepare(self, engine):
        """Profile verify(B, 1+k) + draft(B, k) once, on the engine's own forward passes."""
        if self.costs is not None:
            return
        grid, verify, draft = self.profile(engine)
        self.set_profile(grid, {k: [v + d for v, d in zip(verify[k], draft[k])] for k in verify})

    def profile(self, engine):
        """(batch grid, {k: verify seconds per grid size}, {k: draft seconds per grid size}): each point
        the best of PROFILE_REPEATS, the points interleaved (every point once per round, after one
        untimed round): a machine whose speed drifts while it profiles slows every point alike
        instead of the ks profiled last (a profile taken k by k priced a whole k up or down)."""
        grid = batch_grid(engine.config.max_batch_size)
        ks = range(self.k + 1)
        verify = {k: [math.inf] * len(grid) for k in ks}
        draft = {k: [math.inf] * len(grid) for k in ks}
        for timed in [False] + [True] * PROFILE_REPEATS:
            for i, b in enumerate(grid):
                for k in ks:
                    v = engine.profile_verify(b, 1 + k, repeats=1, warm_up=False)
                    d = engine.profile_draft(b, k, repeats=1, warm_up=False)
                    if timed:
                        verify[k][i], draft[k][i] = min(verify[k][i], v), min(draft[k][i], d)
        return grid, monotone_envelope(verify), monotone_envelope(draft)

    def set_profile(self, grid, step_s):
        """The step costs: step_s[k][i] seconds of a k-draft step at grid[i] rows, linear in between."""
        self.costs = [None] + [[interpolate(grid, step_s[k], b) for k in range(self.k + 1)]
                               for b in range(1, grid[-1] + 1)]

    def acceptance(self):
        """Per position, rows accepted over rows reached, with ACCEPT_PRIOR_ROWS rows at the previous
        position's rate (a deep position seen in few rows stays near the shallower one)."""
        out, prior = [], self.accept_prior
        for drafted, accepted in zip(self.drafted, self.accepted):
            prior = (accepted + ACCEPT_PRIOR_ROWS * prior) / (drafted + ACCEPT_PRIOR_ROWS)
            out.append(prior)
        return out

    def cost_correction(self):
        """Per k, measured over profiled seconds of the steps run with k drafts; a k not run yet takes
        the largest of the others (1 before any step). Why: the profile (dummy tokens, no verification
        or bookkeeping) prices a drafting step below its real cost, more so as rows grow; priced by
        the profile alone, the schedule drafted k = 1 at 32 rows where plain decoding was 1.25x faster."""
        if not self.corrects_costs:
            return [1.0] * (self.k + 1)
        known = [m / p for m, p in zip(self.measured_s, self.profiled_s) if p > 0]
        fallback = max(known) if known else 1.0
        return [m / p if p > 0 else fallback for m, p in zip(self.measured_s, self.profiled_s)]

    def forget_thin_cost_evidence(self):
        """Drop a k's measured/profiled sums once they are worth less than COST_FORGET_STEPS 1-row
        steps: a k priced out by one slow generate is never run, so never re-measured; without its
        own evidence it takes the other ks' correction (cost_correction) and is tried where that pays."""
        for k in range(self.k + 1):
            if self.profiled_s[k] < COST_FORGET_STEPS * self.costs[1][k]:
                self.measured_s[k] = self.profiled_s[k] = 0.0

    def best_k(self, b, correction=None):
        """argmax_k E(k) / cost(b, k), the smaller k on a tie (B cancels)."""
        costs = self.costs[b]
        correction = correction or [1.0] * (self.k + 1)
        return max(range(self.k + 1), key=lambda k: (self.tokens[k] / max(costs[k] * correction[k], 1e-12), -k))

    def begin(self, weight_version=None):
        """Shrink the evidence if the weights changed, then write this generate's schedule."""
        if weight_version != self.weight_version:  # the draft may have changed: its evidence counts less
            self.weight_version = weight_version
            self.drafted = [n * ACCEPT_KEEP_PER_LOAD for n in self.drafted]
            self.accepted = [n * ACCEPT_KEEP_PER_LOAD for n in self.accepted]
        self.tokens = [expected_tokens(self.acceptance(), k) for k in range(self.k + 1)]
        if self.costs is not None:
            self.write_schedule()
            self.age_cost_evidence()
        self.trace = new_trace()

    def write_schedule(self):
        """This generate's k for every batch size."""
        correction = self.cost_correction()
        self.lookup = [0] + [self.best_k(b, correction) for b in range(1, len(self.costs))]

    def age_cost_evidence(self):
        """The correction follows the machine's load: older steps count less at each generate."""
        self.measured_s = [x * COST_KEEP_PER_GENERATE for x in self.measured_s]
        self.profiled_s = [x * COST_KEEP_PER_GENERATE for x in self.profiled_s]
        self.forget_thin_cost_evidence()

    def choose(self, batch_size):
        k = self.scheduled_k(batch_size)
        self.trace["k_rows"] += k * batch_size
        self.trace["rows"] += batch_size
        return k

    def scheduled_k(self, batch_size):
        """This generate's k for batch_size rows (the schedule written at `begin`)."""
        return ScheduleK.choose(self, batch_size)

    def observe(self, step):
        """Count the rows that reached and accepted each draft position; trace predicted vs measured."""
        for i, (d, a) in enumerate(zip(step.drafted_per_pos[:self.k], step.accepted_per_pos)):
            self.drafted[i] += d
            self.accepted[i] += a
        if self.costs is None:
            return
        b, k, t = min(step.batch_size, len(self.costs) - 1), step.k_verified, self.trace
        t["plain_s_pred"] += step.emitted * self.costs[b][0] / b
        t["measured_s"] += step.verify_s + (step.draft_s or 0.0)
        self.record_cost(b, step)
        t["pred_tokens"] += b * self.tokens[k]
        t["pred_s"] += self.priced(b, step)
        t["emitted"] += step.emitted

    def record_cost(self, b, step):
        """Add what `step` (b rows) took and what the profile priced it at to its k's evidence."""
        self.measured_s[step.k_verified] += step.verify_s + (step.draft_s or 0.0)
        self.profiled_s[step.k_verified] += self.priced(b, step)

    def priced(self, b, step):
        """What the profile prices `step` at (b rows): a step verifying and drafting k."""
        return self.costs[b][step.k_verified]

    def summary(self):
        """spec_k_mean (row-weighted) and predicted vs measured speedup over plain decoding."""
        t = self.trace
        if not t["rows"] or not t["measured_s"] or not t["pred_s"]:
            return {}
        plain_rate = t["emitted"] / max(t["plain_s_pred"], 1e-12)  # predicted plain tokens/s here
        return {"spec_k_mean": t["k_rows"] / t["rows"],
                "spec_predicted_speedup": (t["pred_tokens"] / t["pred_s"]) / plain_rate,
                "spec_measured_speedup": (t["emitted"] / t["measured_s"]) / plain_rate}


class CostEvidence:
    """What one part of real steps (their verify, their drafting, the proposer's work at steps without
    drafts) took beyond what the profile priced it at: decayed sums of that difference and of the
    steps, per batch bucket (the profile's grid point nearest the step's batch size), pooled over
    every q and k. Why added, not multiplied: the difference is mostly the engine's host work around
    a forward (sampling draws, acceptance, bookkeeping per row; the catch-up of more positions than
    the probe's), which is about the same for any q: a real verify of 2 rows took 1.6x its profile,
    and scaling every q's price by that priced each more verified draft 1.6x too dear, so steps were
    sized short and blocks not drafted where they paid. Why pooled over sizes: one correction per
    size priced each q by its own steps only, so a q never run kept the largest of the others' and
    was never tried."""

    def __init__(self, grid):
        self.grid = grid
        self.extra_s, self.steps, self.tokens = [0.0] * len(grid), [0.0] * len(grid), [0.0] * len(grid)

    def add(self, i, measured_s, profiled_s, tokens=0):
        """A step at bucket i: its measured and profiled seconds, the tokens it emitted."""
        self.extra_s[i] += measured_s - profiled_s
        self.steps[i] += 1.0
        self.tokens[i] += tokens

    def nearest_known(self, i):
        """The bucket nearest bucket i with evidence worth COST_FORGET_STEPS steps, None if there is none."""
        known = [j for j in range(len(self.grid)) if self.steps[j] >= COST_FORGET_STEPS]
        return min(known, key=lambda j: (abs(self.grid[j] - self.grid[i]), j)) if known else None

    def offset(self, i):
        """Seconds a step at bucket i takes beyond its profiled price: the mean at the nearest bucket with
        evidence (i's own first), None without evidence."""
        j = self.nearest_known(i)
        return None if j is None else self.extra_s[j] / self.steps[j]

    def per_token(self, i):
        """The same extra seconds per token those steps emitted, None without evidence."""
        j = self.nearest_known(i)
        return None if j is None or self.tokens[j] <= 0 else self.extra_s[j] / self.tokens[j]

    def age(self, keep):
        self.extra_s = [x * keep for x in self.extra_s]
        self.steps = [x * keep for x in self.steps]
        self.tokens = [x * keep for x in self.tokens]


class OptionRates:
    """Tokens per second that real steps of one option (plain decoding, or the block drafted) reached,
    per batch bucket: decayed sums of their verifies' seconds, steps and emitted tokens and of their
    draftings' seconds and steps. Why measured and not priced: on a CPU shared with other work a
    step's speed swings by a third within seconds, and the profile's best-of probes and real steps'
    averages differ by that much again; measured rates include every cost the profile leaves out.
    Each bucket also keeps its last rate for RATE_KEEP_GENERATES generates (`estimate`), for when the
    option stops running there."""

    def __init__(self, grid):
        n = len(grid)
        self.verify_s, self.verify_steps, self.tokens = [0.0] * n, [0.0] * n, [0.0] * n
        self.draft_s, self.draft_steps = [0.0] * n, [0.0] * n
        self.last = [None] * n  # per bucket: (last rate measured there, the expected tokens then)
        # per bucket, generates since the option's last step there: a rate from decayed steps is that old
        self.since = [math.inf] * n
        self.keep = [RATE_KEEP_GENERATES] * n  # per bucket, generates the last rate stands after the last step
        self.lost = [False] * n  # per bucket, whether the last measured choice there ruled the option out

    def add_verify(self, i, seconds, tokens):
        self.since[i] = 0
        self.verify_s[i] += seconds
        self.verify_steps[i] += 1.0
        self.tokens[i] += tokens

    def add_draft(self, i, seconds, steps=1.0):
        self.draft_s[i] += seconds
        self.draft_steps[i] += steps

    def rate(self, i, min_steps=RATE_STEPS):
        """Tokens per second at bucket i (a verify's tokens over a verify's and a drafting's seconds),
        None before `min_steps` of each part."""
        if self.verify_steps[i] < min_steps or self.draft_steps[i] < min_steps:
            return None
        seconds = self.verify_s[i] / self.verify_steps[i] + self.draft_s[i] / self.draft_steps[i]
        return self.tokens[i] / self.verify_steps[i] / max(seconds, 1e-12)

    def estimate(self, i, tokens=None, min_steps=RATE_STEPS):
        """The rate at bucket i: measured now (from `min_steps` steps), else the last one measured there if the
        option ran there within its keep (RATE_KEEP_GENERATES, or more after retries: `chosen`), scaled by
        `tokens` (the option's expected tokens per row now) over what they were then (None: not scaled), else
        None. Why kept: once the schedule stops running an option at a batch size its rate expires within two
        generates, and a choice that then fell back to the profile's
        price put the slower option back every few generates (plain decoding measured 1.2x the block at
        128 rows, the price drafted the block again). Why not for good: a rate measured during a burst
        of load would rule its option out for good."""
        rate = self.rate(i, min_steps)
        if rate is not None:
            self.last[i] = (rate, tokens)
            return rate
        if self.last[i] is None or self.since[i] >= self.keep[i]:
            return None
        rate, then = self.last[i]
        return rate if tokens is None or not then else rate * tokens / then

    def chosen(self, i, won, loss=0.0):
        """The measured choice at bucket i kept the option (`won`) or ruled it out, `loss` being the share of time
        it would lose there (the other's rate over its own, less 1). Ruled out again by what it measured at the
        ending generate (a retry), its last rate stands twice as long, or loss / RETRY_SHARE generates where that
        is longer (up to RATE_KEEP_MAX_GENERATES); kept, RATE_KEEP_GENERATES again. Why: each retry costs a
        generate's worth of the option's loss there, and at 64 rows of short answers the block measured
        0.55-0.75x plain decoding at every retry of both buckets the rows drain through. Why only from a retry
        on: the first verdict may be one burst of load's."""
        if won:
            self.keep[i] = RATE_KEEP_GENERATES
        elif self.lost[i] and self.since[i] == 0:
            self.keep[i] = min(max(2 * self.keep[i], math.ceil(loss / RETRY_SHARE)), RATE_KEEP_MAX_GENERATES)
        self.lost[i] = not won

    def age(self, keep):
        for name in ("verify_s", "verify_steps", "tokens", "draft_s", "draft_steps"):
            setattr(self, name, [x * keep for x in getattr(self, name)])
        self.since = [n + 1 for n in self.since]


class PairedEvidence:
    """Per batch bucket, what comparisons of the block with plain decoding inside one generate found: decayed
    sums of log(block rate / plain rate / the block's expected tokens then) and of their weights (one per
    comparing generate). Why within one generate: this CPU's speed moves by a fifth between generates half a
    second apart, so rates measured in different generates (OptionRates) compared the machine's moments as
    much as the options: at 128 rows the block measured 0.79-1.07x plain decoding from one generate to the
    next, and the schedule drafted there in a third of them; runs of a few steps of each, alternated, share
    the machine's speed. Divided by the expected tokens, a ratio follows the draft's acceptance as it moves."""

    def __init__(self, grid):
        self.log_sum, self.weight = [0.0] * len(grid), [0.0] * len(grid)
        self.verdict = [None] * len(grid)  # per bucket, whether its last comparison found the block worth drafting

    def add(self, i, ratio, tokens):
        self.log_sum[i] += math.log(ratio / tokens)
        self.weight[i] += 1.0

    def ratio(self, i, tokens):
        """The block's rate over plain decoding's at bucket i with `tokens` expected tokens now, None where
        the evidence is worth less than PAIR_FORGET."""
        if self.weight[i] < PAIR_FORGET:
            return None
        return math.exp(self.log_sum[i] / self.weight[i]) * tokens

    def age(self, keep):
        self.log_sum = [x * keep for x in self.log_sum]
        self.weight = [x * keep for x in self.weight]


class ConfidenceSizedK(AdaptiveK):
    """A schedule of how much to draft, priced as its steps will be sized, and each step's verification
    sized by the drafts' confidence (vLLM's enable_adaptive_verification; see module doc)."""

    accept_prior = 1.0  # every draft passes until drafted blocks say otherwise (module doc)
    sizes_verification = True
    generates = 0  # generates begun with a profile
    sized = False  # True once a step was sized by confidences (a draft without the head never is)
    comparing = frozenset()  # the batch buckets this generate compares the block with plain decoding at
    contested = frozenset()  # buckets whose last verdict differs from the one before: the next generate compares
    # a step's verify without drafts, with drafts (more tokens to accept and record), its drafting, and
    # the proposer's work at a step without drafts
    PARTS = ("plain", "verify", "draft", "idle")

    def prepare(self, engine):
        if self.costs is not None:
            return
        self.set_costs(*self.profile(engine))

    def set_costs(self, grid, verify, draft):
        """The profile: {k: seconds at each grid batch size} of a verify of 1+k tokens and of drafting k."""
        self.set_profile(grid, {k: [v + d for v, d in zip(verify[k], draft[k])] for k in verify})
        sizes = range(1, grid[-1] + 1)
        self.verify_s = [None] + [[interpolate(grid, verify[k], b) for k in verify] for b in sizes]
        self.draft_s = [None] + [[interpolate(grid, draft[k], b) for k in draft] for b in sizes]
        self.evidence = {part: CostEvidence(grid) for part in self.PARTS}
        self.rates = {option: OptionRates(grid) for option in ("plain", "block")}
        self.grid, self.paired = grid, PairedEvidence(grid)
        self.measured = [(None, None)] * len(grid)  # per bucket, the rates the measured choice reads (write_schedule)
        # per batch size, {k: the generate that last ran k there with steps at its bucket} (write_schedule)
        self.ran_at = [{} for _ in range(grid[-1] + 1)]
        self.catch_up_s = self.catch_up_positions = 0.0  # decayed sums over the catch-ups of switches to drafting
        self.start_generate_pairs()
        self.bucket_of = [None] + [nearest_bucket(grid, b) for b in sizes]
        self.step_offsets = [None] + [(0.0,) * len(self.PARTS)] * grid[-1]  # offsets(b) at this generate's start

    def bucket_offsets(self, i):
        """At bucket i, each part's seconds beyond the profile and the drafting verifies' extra per token
        (CostEvidence; None without evidence): what `offsets` reads, once a bucket."""
        return tuple(self.evidence[part].offset(i) for part in self.PARTS) + (self.evidence["verify"].per_token(i),)

    def offsets(self, b, at_bucket=None):
        """(plain, verify, drafting, no-drafts) seconds real steps of b rows took beyond the profile
        (CostEvidence; `at_bucket`: bucket_offsets of b's bucket, if already read). A plain verify without
        evidence takes the drafting verifies' extra per emitted token for its b tokens (their host work is
        mostly per token: appending, recording, drawing), a drafting verify without evidence the plain one's;
        anything else without evidence 0; all 0 where the profile is the whole price (`corrects_costs` False)."""
        if not self.corrects_costs:
            return (0.0,) * len(self.PARTS)
        plain, verify, draft, idle, per_token = at_bucket or self.bucket_offsets(self.bucket_of[b])
        if plain is None:
            plain = None if per_token is None else per_token * b
        verify = verify if verify is not None else plain
        return tuple(0.0 if x is None else x for x in (plain, verify, draft, idle))

    def price(self, b, q, k, offsets):
        """Seconds of a step at b rows verifying q drafts of k drafted: the profile's plus `offsets`."""
        plain, verify, draft, idle = offsets
        return max(self.verify_s[b][q] + (verify if q else plain) + self.draft_s[b][k] + (draft if k else idle), 1e-12)

    def record_cost(self, b, step):
        """The step's parts into the cost evidence, and from the second generate on into its option's rate:
        the first generate's steps include the first call of every step shape, which made the block's
        first rate at 1 row half of what its later steps reached."""
        i, q = self.bucket_of[b], step.k_verified
        self.generate_buckets.add(i, step)
        rated = self.generates > 1
        if rated:
            for rates in (self.rates, self.generate_rates):
                rates["block" if q else "plain"].add_verify(i, step.verify_s, step.emitted)
        self.evidence["verify" if q else "plain"].add(i, step.verify_s, self.verify_s[b][q], step.emitted)
        if step.draft_s is not None:
            k = step.k_drafted or 0
            if rated:
                for rates in (self.rates, self.generate_rates):
                    rates["block" if k else "plain"].add_draft(i, step.draft_s)
            self.evidence["draft" if k else "idle"].add(i, step.draft_s, self.draft_s[b][k])
            positions, seconds = step.caught_up  # the price of a switch to drafting (price_switches)
            self.catch_up_s += seconds
            self.catch_up_positions += positions

    def observe_prefill(self, batch_size, k, seconds):
        """The proposer's work after a prefill counts in the drafting seconds of the option chosen then, at
        no step of its own: a block drafted from admission writes the context of every prompt there,
        where plain decoding defers it to the rows still running when drafting starts (a catch-up the
        block steps there pay). Per step alone, the block at 128 rows measured up to 1.13x plain
        decoding's rate while whole generates drafting it there ran at 0.91-0.94x of plain; this context
        write (8 ms of a 300 ms generate there) is one of the costs steps alone leave out."""
        if self.costs is not None and self.generates > 1:
            b = min(batch_size, len(self.costs) - 1)
            for rates in (self.rates, self.generate_rates):
                rates["block" if k else "plain"].add_draft(self.bucket_of[b], seconds, steps=0.0)

    def age_cost_evidence(self):
        self.generates += 1
        for evidence in list(self.evidence.values()) + list(self.rates.values()):
            evidence.age(COST_KEEP_PER_GENERATE)
        self.catch_up_s *= COST_KEEP_PER_GENERATE  # the seconds per position stay; later catch-ups weigh more
        self.catch_up_positions *= COST_KEEP_PER_GENERATE

    # ---- paired comparisons inside one generate (PairedEvidence) ----
    def start_generate_pairs(self):
        """A generate starts: its own rates per option, its steps per bucket and its bucket log from zero."""
        self.generate_rates = {option: OptionRates(self.grid) for option in ("plain", "block")}
        self.bucket_steps = [0] * len(self.grid)
        self.generate_buckets = GenerateBuckets(self.grid)

    def pick_comparisons(self):
        """The buckets the new generate compares at: where the last one emitted PAIR_MIN_STEPS tokens a row (the
        steps plain decoding takes for them) and the paired evidence, aged a generate, is worth less than
        PAIR_STALE (less where it has the block losing: `pair_stale`). Why tokens and not steps: a bucket where
        the block drafts runs a third of the steps, and counted in steps it dropped below the threshold and was
        never compared again."""
        self.paired.age(PAIR_KEEP_PER_GENERATE)
        ended = self.generate_buckets
        self.comparing = {i for i in range(len(self.grid))
                          if self.sized and ended.rows[i] and ended.tokens[i] >= PAIR_MIN_STEPS * ended.rows[i]
                          and (self.paired.weight[i] < self.pair_stale(i) or i in self.contested)}
        self.start_generate_pairs()

    def pair_stale(self, i):
        """The paired evidence's weight at bucket i below which the next generate compares there: PAIR_STALE, or
        where the evidence has the block losing a share L of plain decoding's time, lower by as many generates
        beyond PAIR_STALE's 10 as make L a RETRY_SHARE of the generates between comparisons (up to
        PAIR_LOSING_EXTRA_MAX). Why: a comparison runs the block for most of the bucket, and at 128 rows, where
        it ran at 0.85x plain decoding, one generate in ten paid that."""
        ratio = self.paired.ratio(i, self.tokens[self.k])
        if ratio is None or ratio >= 1:
            return PAIR_STALE
        waits = math.ceil((1 / ratio - 1) / RETRY_SHARE)
        extra = min(max(waits - PAIR_STALE_AFTER, 0), PAIR_LOSING_EXTRA_MAX)
        return PAIR_STALE * PAIR_KEEP_PER_GENERATE ** extra

    def fold_pairs(self):
        """The generate that ends: at every bucket it compared where both options' rates were measured, their
        ratio into the paired evidence, divided by the block's expected tokens at the acceptance measured up to
        its end. Why not at its start: at a draft's first comparison that is the prior (every draft passes), and a
        block measured 1.45x plain decoding at 1 row, counted over 4 expected tokens where its drafts gave 2.6,
        was taken for 0.94x. A verdict (the block
        DRAFT_MARGIN faster, or not) other than the bucket's last one (at its first comparison: the schedule the
        generate ran there) marks the bucket contested: the next generate compares it again, until two verdicts
        in a row agree. Why: the plain run is a few steps and the block the rest of the bucket, at 1 row seconds
        later, so a burst of load on the machine in between can overturn one comparison, and one overturned at 1
        row (the block 1.5x plain decoding) had decoded plainly for the ten generates until the next. Where the
        two options are about as fast, verdicts alternate and the bucket is compared at every generate, which
        costs little there: either option is as good."""
        plain, block = self.generate_rates["plain"], self.generate_rates["block"]
        tokens = expected_tokens(self.acceptance(), self.k)  # with what the generate's own drafts measured
        contested = set()
        for i in sorted(self.comparing):
            p, b = plain.rate(i, PAIR_RATE_STEPS), block.rate(i, PAIR_RATE_STEPS)
            if p is not None and b is not None:
                self.paired.add(i, b / p, tokens)
                verdict = pays(b / p)
                last = self.paired.verdict[i]
                if verdict != (self.lookup[self.grid[i]] > 0 if last is None else last):
                    contested.add(i)
                self.paired.verdict[i] = verdict
        self.contested = contested

    def begin(self, weight_version=None):
        """Fold the ending generate's paired comparisons in (at its expected tokens), AdaptiveK's begin (the
        schedule), then the buckets this generate compares at."""
        if self.costs is None:
            return super().begin(weight_version)
        self.fold_pairs()
        super().begin(weight_version)
        self.pick_comparisons()

    def drafts_this_generate(self):
        return bool(self.comparing) or super().drafts_this_generate()

    def scheduled_k(self, batch_size):
        """The schedule's k, except at a bucket compared this generate: its first PAIR_RUN_STEPS steps draft
        nothing, the rest the block. Why plain decoding first and the block to the end: drafting leaves the
        rows' lengths apart (each accepts its own count) and a step's attention pads every row to the longest,
        a cost that grows over the block's steps. Alternated runs left it to the plain steps after block ones
        and missed most of it in the block's short runs: at 128 rows, all prompts of one length, they measured
        plain steps 10 % slower than plain generates' steps and the block 1.17x plain decoding, where the steps
        of block generates measured 1.04-1.07x those of plain ones."""
        if self.costs is None:
            return super().scheduled_k(batch_size)
        i = self.bucket_of[min(max(batch_size, 1), len(self.costs) - 1)]
        self.bucket_steps[i] += 1
        if i not in self.comparing:
            return super().scheduled_k(batch_size)
        return 0 if self.bucket_steps[i] <= PAIR_RUN_STEPS else self.k

    def measured_choice(self, b):
        """The block or nothing by the rates real steps of each reached near b rows (OptionRates
        `estimate`: the block's last rate scaled by its expected tokens now over then), the block where it
        ran DRAFT_MARGIN faster; where only one of them was measured, the other (to compare: where the
        price drafts, plain decoding ran at no generate otherwise, though 1.04x the block at 128 rows; where
        it does not, the block ran at none, though 1.25x plain decoding at 2 rows), unless a generate within
        that option's retry wait there (OptionRates `keep`) ran it there without a step of it rated (it may never
        be: at 64 rows of short answers the block, drafted at a bucket's last step for the next bucket, was tried
        at every generate, and then, when only the next one was spared, at every other); None where neither was.
        At a bucket the ending generate ran fewer than RATE_STEPS steps at, a rate counts from THIN_RATE_STEPS:
        waiting for RATE_STEPS there left the measured option's rate against nothing, and the block, never
        rated at the two steps a generate of 64 rows draining gave it, was tried at every generate, at
        0.75x plain decoding's rate."""
        if not self.corrects_costs:  # the profile is the whole price
            return None
        plain, block = self.measured[self.bucket_of[b]]
        if plain is None and block is None:
            return None
        if plain is None or block is None:
            untried, measured = (self.k, 0) if block is None else (0, self.k)
            # the option without a rate had its chance: a generate within its wait ran it here and stepped here,
            # and no step of it could be rated (drafts made at a bucket's last step are verified at the next bucket)
            ran = self.ran_at[b].get(untried)
            wait = self.rates["block" if untried else "plain"].keep[self.bucket_of[b]]
            return measured if ran is not None and self.generates - ran < wait else untried
        return self.k if pays(block / plain) else 0

    def measured_rates(self, steps):
        """Per bucket, (plain decoding's, the block's) rate for the measured choice (OptionRates `estimate`), from
        RATE_STEPS steps of each, or THIN_RATE_STEPS where the ending generate ran fewer than RATE_STEPS there."""
        rates = []
        for i, n in enumerate(steps):
            min_steps = THIN_RATE_STEPS if n < RATE_STEPS else RATE_STEPS
            rates.append((self.rates["plain"].estimate(i, min_steps=min_steps),
                          self.rates["block"].estimate(i, self.tokens[self.k], min_steps=min_steps)))
        return rates

    def note_choices(self):
        """Each bucket's measured choice, once a generate, into its options' retry waits (OptionRates `chosen`)."""
        for i, (plain, block) in enumerate(self.measured):
            if plain is not None and block is not None:
                drafts = pays(block / plain)
                self.rates["block"].chosen(i, drafts, plain / block - 1)
                self.rates["plain"].chosen(i, not drafts, block / plain - 1)

    def write_schedule(self):
        """Every batch size's offsets for this generate (its steps are sized with them), then its k."""
        # every batch size's offsets, each bucket's evidence read once (a schedule at 128 rows has 128 of them)
        buckets = [self.bucket_offsets(i) for i in range(len(self.grid))] if self.corrects_costs else None
        self.step_offsets = [None] + [self.offsets(b, buckets and buckets[self.bucket_of[b]])
                                      for b in range(1, len(self.costs))]
        steps = self.generate_buckets.steps
        # each bucket's measured rates, read once (every batch size's choice reads its bucket's)
        self.measured = self.measured_rates(steps) if self.corrects_costs else self.measured
        rated = self.generates > 1  # the ending generate's steps were rated (record_cost); its schedule was written
        for b in range(1, len(self.costs)) if rated else ():  # where the ending generate stepped with rated steps
            if steps[self.bucket_of[b]]:
                self.ran_at[b][self.lookup[b]] = self.generates
        if self.sized and self.corrects_costs:
            self.note_choices()
        self.lookup = [0] + [self.best_k(b) for b in range(1, len(self.costs))]
        if self.sized:
            self.price_switches()

    def price_switches(self):
        """Plain decoding over each run of drafting buckets that rows enter from plain decoding (the ending
        generate stepped at a plain bucket above the run) where catching up their draft context there costs more
        than drafting saved in the run: the catch-up priced at the seconds per position caught up so far times
        the positions the ending generate's rows held at its first step in the run; the saving at each bucket
        of the run, its tokens in the ending generate at plain decoding's price per token times 1 - plain's
        rate over the block's there (`block_ratio`). Why: a switch pays the catch-up once for every position since
        admission, which the block's rate at that bucket spreads over its steps there and nothing prices against
        the few steps left after it; at 128 rows draining to the end of short answers, the block drafted from 64
        rows on made whole generates 0.95x plain decoding."""
        if not self.catch_up_positions:
            return
        per_position = self.catch_up_s / self.catch_up_positions
        ended = self.generate_buckets
        drafting = [self.lookup[b] > 0 for b in self.grid]
        from_plain, i = False, len(self.grid) - 1
        while i >= 0:
            if not drafting[i]:
                from_plain = from_plain or ended.rows[i] > 0
                i -= 1
                continue
            run = []
            while i >= 0 and drafting[i]:
                run.append(i)
                i -= 1
            entered = [ended.context[j] for j in run if ended.rows[j]]
            saves = sum(self.drafting_saves(j, ended.tokens[j]) for j in run)
            if from_plain and entered and saves < per_position * entered[0]:
                self.lookup = [0 if self.bucket_of[b] in run else k for b, k in enumerate(self.lookup)]
            else:
                from_plain = False  # the run drafts: its rows' context is written

    def drafting_saves(self, i, tokens):
        """Seconds drafting the block saves over plain decoding at bucket i for `tokens` emitted there."""
        b = self.grid[i]
        plain_per_token = self.price(b, 0, 0, self.step_offsets[b]) / b
        return tokens * plain_per_token * (1 - 1 / max(self.block_ratio(b), 1e-12))

    def block_ratio(self, b):
        """The block's rate over plain decoding's near b rows: as compared inside one generate (PairedEvidence),
        else as measured where both ran, from a step of each on, or their last rates kept (OptionRates), else as
        priced (`priced_ratio`). The thin rates inform this price only: the choice at a bucket waits for RATE_STEPS.
        Why from one step: the buckets a batch drains through run a step or two a generate, never the RATE_STEPS a
        choice there waits for, and their prices missed what the block's steps there lose (rows ending inside
        a block): at 64 rows draining, the block measured 0.75x plain decoding where its price said 1.3x."""
        i = self.bucket_of[b]
        paired = self.paired_ratio(b)
        if paired is not None:
            return paired
        plain = self.rates["plain"].rate(i, 1.0) or self.rates["plain"].estimate(i)
        block = self.rates["block"].rate(i, 1.0) or self.rates["block"].estimate(i, self.tokens[self.k])
        if plain and block:
            return block / plain
        return self.priced_ratio(b)

    def paired_ratio(self, b):
        """The block's rate over plain decoding's near b rows as compared inside one generate, at the block's
        expected tokens now (None without such evidence)."""
        return self.paired.ratio(self.bucket_of[b], self.tokens[self.k])

    def priced_ratio(self, b):
        """The block's priced rate over plain decoding's at b rows, its steps verifying the q they would size to at
        the acceptance measured so far (the drafting paid), both at this generate's offsets."""
        offsets = self.step_offsets[b]
        q = self.sized_q(b, self.k, self.tokens, offsets)
        return (self.tokens[q] / self.price(b, q, self.k, offsets)) / (self.tokens[0] / self.price(b, 0, 0, offsets))

    def verification_size(self, batch_size, survival):
        """The q where one more draft stops raising (B + sum of the rows' survival of drafts < q) /
        price(B, q, k) (see the module doc for why it stops there)."""
        if self.costs is None:
            return None
        self.sized = True
        b, k = min(batch_size, len(self.costs) - 1), survival.shape[1]
        passed = survival.sum(0).tolist()  # per draft j, the rows' summed chance it is still accepted
        expected = [float(batch_size)]
        for p in passed:
            expected.append(expected[-1] + p)
        q = self.sized_q(b, k, expected, self.step_offsets[b])
        self.count_unverified(batch_size, passed, q)
        return q

    def sized_q(self, b, k, expected, offsets):
        """The q where one more draft stops raising expected[q] / price(b, q, k), expected[q] the tokens
        a step verifying q drafts emits (for all rows, or per row)."""
        def rate(q):
            return expected[q] / self.price(b, q, k, offsets)

        q = 0
        while q < k and rate(q + 1) > rate(q):
            q += 1
        return q

    def best_k(self, b):
        """Once steps are sized by confidence: the measured choice where real plain and block steps both ran
        near b (measured_choice); else the whole block where its steps, each verifying the q it would
        size to at the acceptance measured so far (the drafting paid), are priced DRAFT_MARGIN more per
        second than plain steps (k = 0), else nothing. Why not fewer than the block: AdaptiveK's
        rule verifies all k drafted, so it drafted fewer where verifying a whole block did not pay, and
        then no step could verify more; and a shorter draft saves only Markov steps, a difference the
        profile's noise decided (the schedule drafted 1 of a block at 8 rows and the whole at 4 and 16).
        Until a step is sized (a draft without a confidence head never is), AdaptiveK's rule: every k
        verifies all it drafts, the smaller k on a tie. Both priced by `price` at this generate's offsets."""
        offsets = self.step_offsets[b]
        paired = self.paired_ratio(b) if self.sized else None
        if paired is not None:
            return self.k if pays(paired) else 0
        measured = self.measured_choice(b) if self.sized else None
        if measured is not None:
            return measured
        if self.sized:
            return self.k if pays(self.priced_ratio(b)) else 0
        return min(range(self.k + 1), key=lambda k: (-self.tokens[k] / self.price(b, k, k, offsets), k))

    def count_unverified(self, batch_size, passed, q):
        """The drafts from q on are not verified: count what the confidence expects of them, rows reaching
        draft j (the summed survival of j-1, every row for j = 0) and accepting it (that of j), beside
        the verified drafts' outcomes."""
        for j in range(q, min(len(passed), self.k)):
            self.drafted[j] += passed[j - 1] if j else float(batch_size)
            self.accepted[j] += passed[j]

    def priced(self, b, step):
        """The verify of k_verified drafts plus the draft of k_drafted (sized steps verify fewer than drafted)."""
        drafted = self.draft_s[b][step.k_drafted] if step.k_drafted else 0.0
        return self.verify_s[b][step.k_verified] + drafted


class GenerateBuckets:
    """What one generate did at each batch bucket: its steps, the tokens they emitted, and at its first step there
    the rows and their cached positions (0 rows where it ran none): what a switch to drafting there catches up."""

    def __init__(self, grid):
        self.tokens, self.rows, self.context = [0.0] * len(grid), [0] * len(grid), [0] * len(grid)
        self.steps = [0] * len(grid)

    def add(self, i, step):
        self.steps[i] += 1
        self.tokens[i] += step.emitted
        if not self.rows[i]:
            self.rows[i], self.context[i] = step.batch_size, step.context


def new_trace():
    """This generate's sums for summary(): rows and k x rows chosen, predicted and measured seconds."""
    return dict.fromkeys(("k_rows", "rows", "plain_s_pred", "measured_s", "pred_tokens", "pred_s", "emitted"), 0.0)


def pays(ratio):
    """Whether the block's rate over plain decoding's is worth drafting: DRAFT_MARGIN in plain decoding's favour."""
    return ratio >= 1 + DRAFT_MARGIN


def nearest_bucket(grid, b):
    """The index of the grid point nearest b (the lower on a tie)."""
    return min(range(len(grid)), key=lambda i: (abs(grid[i] - b), i))


def interpolate(grid, ys, b):
    """ys (one per grid batch size) at b, linear between grid points."""
    if b <= grid[0]:
        return ys[0] * b / grid[0]
    for x0, x1, y0, y1 in zip(grid, grid[1:], ys, ys[1:]):
        if b <= x1:
            return y0 + (y1 - y0) * (b - x0) / (x1 - x0)
    return ys[-1]


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


def batch_grid(max_batch_size):
    """1, 2, 4, ... up to and including max_batch_size."""
    grid = [2 ** i for i in range(int(math.log2(max_batch_size)) + 1)]
    return grid if grid[-1] == max_batch_size else grid + [max_batch_size]


def build_k_policy(spec, adaptive, max_batch_size):
    """The policy for a SpecConfig (None: no speculation) and the --spec-adaptive flag."""
    if spec is None:
        return FixedK(0)
    if spec.enable_adaptive_verification:
        return ConfidenceSizedK(spec.num_speculative_tokens)
    if adaptive:
        return AdaptiveK(spec.num_speculative_tokens)
    if spec.num_speculative_tokens_per_batch_size is not None:
        return ScheduleK(spec.num_speculative_tokens_per_batch_size, spec.num_speculative_tokens, max_batch_size)
    return FixedK(spec.num_speculative_tokens)
