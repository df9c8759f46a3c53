"""How many tokens to draft at each engine step, and how many of them the step verifies.

The engine asks its policy for k before each step (`choose(batch_size)`) and tells a policy that
observes what the step did (`observe`). A policy changes how much is drafted and verified, never how
a draft is verified, so every policy keeps the output exact.

  FixedK      k = num_speculative_tokens (vLLM's default).
  ScheduleK   vLLM's `num_speculative_tokens_per_batch_size`: inclusive batch-size ranges
              [(start, end, k), ...]; gaps and the tail carry the previous k; capped at num_speculative_tokens.
  AdaptiveK   vime's --spec-adaptive: at every generate, k(B) = argmax_k E(k) / cost(B, k) per batch size B.
              E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j, a_j the acceptance at draft position j (rows accepted over
              rows that reached it, shrunk toward the previous position's; the counts shrink on new weights).
              cost(B, k) = verify(B, 1+k) + draft(B, k), profiled once at start-up (step_costs.py), each k's
              price scaled by what real k-draft steps took over it (`cost_correction`, decayed, dropped once thin;
              a k not run yet priced against drafting).
  ConfidenceSizedK  vLLM's `enable_adaptive_verification` (DSpark's confidence head): the whole block or
              nothing per batch size, as `num_speculative_tokens_per_batch_size` says, else where the profile
              prices the block's sized steps DRAFT_MARGIN faster than plain decoding; a drafting step verifies
              `sized_q` of its drafts.

Verification sized by confidence, beside vLLM's (v1/worker/gpu/spec_decode/adaptive_verification.py; the two
side by side in docs/drafts.md): both score draft j of a row by its survival s_j, the running product of the
row's confidences, and price steps from a cost profile taken once at start-up. vLLM's verify costs per token,
so it admits single (row, draft) slots, the highest survivals first; this engine's verify pads every row to
the longest, so `sized_q` gives every row the same q, grown one draft at a time while
(B + sum_rows sum_{j<q} s_j) / cost(q) rises. Growing rather than taking the argmax keeps sampled drafts exact:
whether draft j is verified depends on the survivals up to j, which the drafts before j decide (the
confidence of slot j reads the token drafted at j - 1), never on draft j itself.
"""
from collections import namedtuple

import torch

from rollout.embedded.step_costs import interpolate, profile_steps

ACCEPT_PRIOR = 0.5  # acceptance assumed before a position was ever drafted
ACCEPT_PRIOR_ROWS = 8  # pseudo-rows of prior (the previous position's rate) in each estimate
ACCEPT_KEEP_PER_LOAD = 0.5  # share of the row counts kept when a generate runs on new weights
COST_KEEP_PER_GENERATE = 0.5  # share of the measured/profiled step seconds kept at each generate
COST_FORGET_STEPS = 1.0  # a k's measured/profiled evidence below this many 1-row steps is dropped
# how much faster than plain decoding the profile must price the block: its probes leave out a real step's host
# work (drawing, accepting, recording), which a drafting step has more of, and the rows' lengths drifting apart
DRAFT_MARGIN = 0.08


class FixedK:
    """Always draft `k` (the proposer's num_speculative_tokens)."""

    observes = False  # the engine builds StepRecords only for policies that learn from them
    sizes_verification = False  # whether verification_size reads confidences (a proposer computes them only then)

    def __init__(self, k):
        self.k = k

    def choose(self, batch_size):  # k for a step of batch_size rows
        return self.k

    def observe(self, step):  # what a step did (a StepRecord), for a policy that `observes`
        pass

    def verification_size(self, batch_size, confidences):
        """[B] drafts each row verifies given the drafts' confidences [B, k] (None: every one drafted).
        Whether draft j is verified may depend on confidences up to j only, or sampled drafts stop being exact."""
        return None

    def prepare(self, engine):  # once, before the first generate (a profile of the engine's passes)
        pass

    def begin(self, weight_version=None):  # a generate starts, on weights `weight_version`
        pass

    def drafts_this_generate(self, rows=None):
        """Whether any step of the generate begun, of `rows` requests, may draft (asked after `begin`)."""
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

    def drafts_this_generate(self, rows=None):
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


StepRecord = namedtuple("StepRecord", "batch_size k_verified verify_s k_drafted draft_s emitted drafted_per_pos "
                        "accepted_per_pos")
StepRecord.__doc__ = """What one engine step did: batch size, k verified / drafted, times, tokens emitted, and per
draft position the rows that reached it and the rows that accepted it."""


def expected_tokens(acceptance, k):
    """Tokens one verify emits per row with k drafts: 1 + sum_i prod_{j<=i} a_j."""
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total


def sized_q(confidences, cost_table, k_max):
    """[B] drafts each row verifies: one q for every row, grown while one more draft raises
    (B + sum_rows sum_{j<q} s_rj) / cost_table[q], s_rj = prod_{i<=j} confidences[r, i] (the chance draft j of
    row r is still accepted); cost_table[q]: seconds of the step verifying q drafts, q = 0..k_max."""
    rows, k = confidences.shape[0], min(k_max, confidences.shape[1])
    passed = confidences[:, :k].double().cumprod(1).sum(0).tolist()
    return torch.full((rows,), grown_q(rows, passed, cost_table), dtype=torch.long)


def grown_q(rows, passed, cost_table):
    """The q where verifying one more draft stops raising (rows + sum_{j<q} passed[j]) / cost_table[q]."""
    q, expected = 0, float(rows)
    while q < len(passed) and (expected + passed[q]) / cost_table[q + 1] > expected / cost_table[q]:
        expected += passed[q]
        q += 1
    return q


class AdaptiveK(ScheduleK):
    """A per-batch-size schedule maximising expected tokens/s, rewritten at every generate from a
    start-up cost profile and the live acceptance estimate (see module doc)."""

    observes = True
    corrects_costs = True  # False: the profile is the whole price
    accept_prior = ACCEPT_PRIOR
    extra_emitted = extra_accepted = 0.0  # drafting steps' tokens beyond one a row, their accepted drafts (`realized`)

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

    def prepare(self, engine):  # the profile, once
        if self.costs is None:
            self.set_costs(*profile_steps(engine, self.k))

    def set_costs(self, grid, verify, draft):
        """The profile: {k: seconds at each grid batch size} of a verify of 1+k tokens and of drafting k."""
        self.set_profile(grid, {k: [v + d for v, d in zip(verify[k], draft[k])] for k in verify})

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
        """Per k, measured over profiled seconds of the steps run with k drafts. A k not run yet is priced
        against drafting: a drafting k takes the largest of the others' ratios (the profile's probes, dummy
        tokens without verification or bookkeeping, price a drafting step below its real cost), plain
        decoding (k = 0) the smallest of them and 1 (its probe is a plain step less only the sampling)."""
        if not self.corrects_costs:
            return [1.0] * (self.k + 1)
        known = [m / p for m, p in zip(self.measured_s, self.profiled_s) if p > 0]
        unmeasured = [min(known + [1.0])] + [max(known, default=1.0)] * self.k
        return [m / p if p > 0 else fallback for m, p, fallback in zip(self.measured_s, self.profiled_s, unmeasured)]

    def begin(self, weight_version=None):
        """Shrink the acceptance evidence if the weights changed, then write this generate's schedule."""
        if weight_version != self.weight_version:  # the draft may have changed: its evidence counts less
            self.weight_version = weight_version
            self.drafted = [n * ACCEPT_KEEP_PER_LOAD for n in self.drafted]
            self.accepted = [n * ACCEPT_KEEP_PER_LOAD for n in self.accepted]
            self.extra_emitted *= ACCEPT_KEEP_PER_LOAD
            self.extra_accepted *= ACCEPT_KEEP_PER_LOAD
        self.tokens = [expected_tokens(self.acceptance(), k) for k in range(self.k + 1)]
        if self.costs is not None:
            self.write_schedule()
            self.age_cost_evidence()
        self.trace = new_trace()

    def write_schedule(self):
        """This generate's k for every batch size: argmax_k E(k) / cost(b, k), the smaller k on a tie."""
        c = self.cost_correction()
        self.lookup = [0] + [max(range(self.k + 1), key=lambda k: (self.tokens[k] / max(costs[k] * c[k], 1e-12), -k))
                             for costs in self.costs[1:]]

    def age_cost_evidence(self):
        """The correction follows the machine's load: older steps count less at each generate, and a k's
        evidence worth less than COST_FORGET_STEPS 1-row steps is dropped (it then takes the others')."""
        self.measured_s = [x * COST_KEEP_PER_GENERATE for x in self.measured_s]
        self.profiled_s = [x * COST_KEEP_PER_GENERATE for x in self.profiled_s]
        for k in range(self.k + 1):
            if self.profiled_s[k] < COST_FORGET_STEPS * self.costs[1][k]:
                self.measured_s[k] = self.profiled_s[k] = 0.0

    def choose(self, batch_size):
        k = ScheduleK.choose(self, batch_size)
        self.trace["k_rows"] += k * batch_size
        self.trace["rows"] += batch_size
        return k

    def observe(self, step):
        """Count the rows that reached and accepted each draft position; trace predicted vs measured."""
        for i, (d, a) in enumerate(zip(step.drafted_per_pos[:self.k], step.accepted_per_pos)):
            self.drafted[i] += d
            self.accepted[i] += a
        if self.costs is None:
            return
        b, t = min(step.batch_size, len(self.costs) - 1), self.trace
        priced = self.priced(b, step)
        self.measured_s[step.k_verified] += step.verify_s + (step.draft_s or 0.0)
        self.profiled_s[step.k_verified] += priced
        t["plain_s_pred"] += step.emitted * self.costs[b][0] / b
        t["measured_s"] += step.verify_s + (step.draft_s or 0.0)
        t["pred_tokens"] += b * self.tokens[step.k_verified]
        t["pred_s"] += priced
        t["emitted"] += step.emitted

    def priced(self, b, step):  # what the profile prices `step` at (b rows)
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


class ConfidenceSizedK(AdaptiveK):
    """The block or nothing per batch size (a schedule, else the profile), each drafting step's verification
    sized by the drafts' confidences (`sized_q`; vLLM's enable_adaptive_verification; see module doc)."""

    accept_prior = 1.0  # every draft passes until drafted blocks say otherwise: a block gets drafted and seen
    corrects_costs = False  # the start-up profile is the whole price
    sizes_verification = True
    sized = False  # True once a step was sized by confidences (a draft without the head never is)

    def __init__(self, k_max, schedule=None, max_batch_size=None):
        super().__init__(k_max)
        self.schedule = None if schedule is None else dense_schedule(schedule, k_max, max_batch_size)
        self.lookup = self.schedule or self.lookup

    def set_costs(self, grid, verify, draft):
        super().set_costs(grid, verify, draft)
        sizes = range(1, grid[-1] + 1)
        self.verify_s = [None] + [[interpolate(grid, verify[q], b) for q in verify] for b in sizes]
        self.draft_s = [None] + [[interpolate(grid, draft[k], b) for k in draft] for b in sizes]

    def cost_table(self, b, k):
        """Seconds of a step at b rows that drafted k, verifying q = 0..k of them."""
        return [self.verify_s[b][q] + self.draft_s[b][k] for q in range(k + 1)]

    def write_schedule(self):
        """The schedule's k, else the block where its steps, each verifying what `sized_q` gives at the acceptance
        measured so far (all k until a step was sized) and emitting the `realized` share of the drafts that
        acceptance passes, are priced DRAFT_MARGIN more tokens per second than plain steps."""
        if self.schedule is not None:
            self.lookup = self.schedule
            return
        survival = [b - a for a, b in zip(self.tokens, self.tokens[1:])]  # each draft's chance to be accepted
        realized, self.lookup = self.realized(), [0]
        for b in range(1, len(self.costs)):
            table = self.cost_table(b, self.k)
            q = grown_q(1, survival, table) if self.sized else self.k
            pays = (1 + (self.tokens[q] - 1) * realized) / table[q] >= (1 + DRAFT_MARGIN) / self.cost_table(b, 0)[0]
            self.lookup.append(self.k if pays else 0)

    def drafts_this_generate(self, rows=None):
        """Without a schedule, a generate that starts where the block does not pay decodes plainly to its end:
        its rows, drained to where it pays, would first write their draft context for every position since
        admission, a cost the profile does not price."""
        if self.schedule is None and rows and not self.lookup[min(rows, len(self.lookup) - 1)]:
            self.lookup = [0] * len(self.lookup)
        return super().drafts_this_generate()

    def realized(self):
        """The share of accepted drafts that drafting steps emitted, ACCEPT_PRIOR_ROWS drafts at 1: a row that
        ends inside a block (a stop token before an accepted draft) emits fewer than its drafts passed."""
        return (self.extra_emitted + ACCEPT_PRIOR_ROWS) / (self.extra_accepted + ACCEPT_PRIOR_ROWS)

    def observe(self, step):
        if step.k_verified:
            self.extra_emitted += step.emitted - step.batch_size
            self.extra_accepted += sum(step.accepted_per_pos)
        super().observe(step)

    def verification_size(self, batch_size, confidences):
        """`sized_q` at batch_size rows; the drafts left unverified count in the acceptance estimate as
        their confidences expect (rows reaching draft j: the summed survival of j-1; accepting it: of j)."""
        if self.costs is None:
            return None
        self.sized = True
        k = confidences.shape[1]
        sizes = sized_q(confidences, self.cost_table(min(batch_size, len(self.costs) - 1), k), k)
        passed = confidences.double().cumprod(1).sum(0).tolist()
        for j in range(int(sizes.max()), min(k, self.k)):
            self.drafted[j] += passed[j - 1] if j else float(batch_size)
            self.accepted[j] += passed[j]
        return sizes

    def priced(self, b, step):  # the verify of k_verified drafts plus the drafting of k_drafted after it
        return self.verify_s[b][step.k_verified] + (self.draft_s[b][step.k_drafted] if step.k_drafted else 0.0)


def new_trace():
    """This generate's sums for summary(): rows and k x rows chosen, predicted and measured seconds."""
    return dict.fromkeys(("k_rows", "rows", "plain_s_pred", "measured_s", "pred_tokens", "pred_s", "emitted"), 0.0)


def build_k_policy(spec, adaptive, max_batch_size):
    """The policy for a SpecConfig (None: no speculation) and the --spec-adaptive flag."""
    if spec is None:
        return FixedK(0)
    if spec.enable_adaptive_verification:
        return ConfidenceSizedK(spec.num_speculative_tokens, spec.num_speculative_tokens_per_batch_size,
                                max_batch_size)
    if adaptive:
        return AdaptiveK(spec.num_speculative_tokens)
    if spec.num_speculative_tokens_per_batch_size is not None:
        return ScheduleK(spec.num_speculative_tokens_per_batch_size, spec.num_speculative_tokens, max_batch_size)
    return FixedK(spec.num_speculative_tokens)
