"""The speculation ceiling: what an oracle choosing k per batch size would gain, from measured costs.

Given the engine's own step records of fixed-k runs over the same rollout batches (seconds of a
step at B rows drafting k tokens, k = 0 being plain decoding) and an acceptance per draft position,
each plain step at B rows is replaced by 1 / E(k) of a k-draft step at B rows with the k cheapest
per emitted token there, E(k) = 1 + sum_i prod_{j<=i} a_j (`expected_tokens`, the adaptive
policy's own objective with its costs known exactly). No k-per-batch-size policy can beat that
oracle on these costs; with every draft accepted it bounds what any draft can buy on the machine.
`scripts/bench/spec_ceiling.py` runs the engine and prints the model's figures.
"""
import statistics

import numpy as np

from rollout.embedded.spec_policy import FixedK, expected_tokens


class StepTimes(FixedK):
    """Fixed k that keeps each step's batch size and seconds (verify + draft) from the engine's StepRecords,
    and per batch-size band the rows that reached each draft position and the rows that accepted it
    (the engine's conditional counts, as the adaptive policy reads them)."""

    observes = True

    def __init__(self, k):
        super().__init__(k)
        self.steps = []
        self.bands = {}  # band -> ([rows reaching position i], [rows accepting it])

    def observe(self, step):
        self.steps.append((step.batch_size, step.verify_s + (step.draft_s or 0.0)))
        reached, accepted = self.bands.setdefault(batch_band(step.batch_size), ([0] * self.k, [0] * self.k))
        for i, (d, a) in enumerate(zip(step.drafted_per_pos, step.accepted_per_pos)):
            reached[i] += d
            accepted[i] += a


def batch_band(b):
    """Batch sizes grouped 1, 2, 3-4, 5-8, 9-16, ...: the groups acceptance is kept by (the drain's
    stragglers draft unlike its full batch)."""
    return (b - 1).bit_length()


def conditional_acceptance(bands):
    """Per draft position over every band: rows that accepted it / rows that reached it."""
    reached = [sum(r) for r in zip(*(band[0] for band in bands.values()))]
    accepted = [sum(a) for a in zip(*(band[1] for band in bands.values()))]
    return [a / r if r else 0.0 for r, a in zip(reached, accepted)]


def acceptance_by_band(bands, overall):
    """b -> conditional acceptance per position measured at b's band (`overall` where a position was
    never reached there). Per band because the long stragglers are the hard answers: one rate for
    all rows overstates what drafting buys in the tail."""
    table = {key: [a / d if d else fallback for d, a, fallback in zip(reached, accepted, overall)]
             for key, (reached, accepted) in bands.items()}
    return lambda b: table.get(batch_band(b), overall)


def cost_curve(steps):
    """B -> median seconds of the steps at B rows, linearly interpolated between the B's seen (flat outside)."""
    by_b = {}
    for b, s in steps:
        by_b.setdefault(b, []).append(s)
    xs = sorted(by_b)
    ys = [statistics.median(by_b[b]) for b in xs]
    return lambda b: float(np.interp(b, xs, ys))


def oracle_time(plain_steps, curves, acceptance_at):
    """(seconds of the plain steps replaced by the cheapest-per-token k at each B, the k chosen per plain
    step); acceptance_at(B): conditional acceptance per position at B rows."""
    total, chosen = 0.0, []
    for b, _ in plain_steps:
        per_token = {k: curve(b) / expected_tokens(acceptance_at(b), k) for k, curve in curves.items()}
        k = min(per_token, key=per_token.get)
        total += per_token[k]
        chosen.append(k)
    return total, chosen


def predicted_fixed_k(plain_steps, k_steps, k_seconds, curve, k, acceptance_at):
    """The model's engine seconds for fixed k: the k run's own time outside its steps, plus each plain
    step replaced by 1 / E(k) of a k step at the same B (checks the model against what ran)."""
    outside = k_seconds - sum(s for _, s in k_steps)
    return outside + sum(curve(b) / expected_tokens(acceptance_at(b), k) for b, _ in plain_steps)
