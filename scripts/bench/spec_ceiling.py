"""What MTP speculation can buy a long-tail RL rollout on this machine, at most.

A GRPO rollout batch (16 prompts x 8 samples, T = 1, the task's long-tail variant) drains from
128 rows to a few stragglers. How much speculation can speed it up is set by two things this
script measures, and the draft's acceptance:

  c_k(B)  seconds of one real engine step at B rows drafting k tokens (k = 0: plain decoding),
          verify forward, verification, bookkeeping and the MTP draft included; measured on the
          same batches with fixed k = 0..K, interleaved, B = every batch size the drain visits;
  t_0(B)  the rows x steps the plain rollout spends at each B (its drain profile);
  a       conditional acceptance per draft position: the checkpoint's own draft, measured per
          batch-size band in the fixed k = K run (the stragglers are the hard answers), or given
          (--acceptance; by default every draft accepted and two drafts measured earlier).

Each plain step at B rows is replaced by 1 / E_a(k) of a k-draft step at B rows with the k that
is cheapest per emitted token there, E_a(k) = 1 + sum_i prod_{j<=i} a_j (the adaptive policy's
own objective, with its costs known exactly): the rollout's time with speculation is

  T_spec = T_rest + sum over plain steps of min_k c_k(B) / E_a(k)

(T_rest: prefill and the loop outside the steps, taken as unchanged, which favours
speculation). T_plain / T_spec is the speedup of an oracle that knows every cost and the
acceptance at every B: no adaptive policy can beat it on these costs. With a = 1 (every
draft accepted) it bounds what any draft can buy on this machine. Rows that finish inside a
step's drafts are not modelled (they favour speculation too). The script checks the model on
what it ran: the fixed-k engine times against the model's prediction for them. Beside the oracle
it reports the real `--spec-adaptive` engine on the same batches.

    python scripts/bench/spec_ceiling.py [--hf-checkpoint checkpoints/tiny-mimo-longtail] [--batches 16]
        [--acceptance "online end=0.70,0.13,0.13" ...]

Strict verification reproduces plain sampling token for token, so every k rolls out the same
responses: the script checks it, and the costs compare the same work.
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rollout.embedded.engine import EngineConfig  # noqa: E402
from rollout.embedded.engine_builder import build_engine  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from rollout.embedded.spec_policy import FixedK, expected_tokens  # noqa: E402
from scripts.bench.slot_compaction import PROMPTS_PER_BATCH, SAMPLES_PER_PROMPT, rollout_batches  # noqa: E402
from vime.errors import exit_on_user_error, require  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402

# conditional acceptance per position: every draft accepted, the online draft at the end of the
# long-tail drift run (BENCHMARKS.md: 0.70 at position 1, 1.79 tokens per verify at k = 2),
# and the best online draft measured (0.88 / 0.66 / 0.53 absolute by position)
DEFAULT_SCENARIOS = ("every draft accepted=1,1,1", "online draft, long-tail drift end=0.70,0.13,0.13",
                     "best online draft=0.88,0.75,0.80")


ADAPTIVE = "adaptive"


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
    never reached there). Why per band: the long stragglers are the hard answers (on the long-tail
    RL checkpoint, 0.52 at position 1 on <= 8 rows against 0.72 over the whole batch), so one
    rate for all rows overstated what drafting buys in the tail."""
    table = {key: [a / d if d else fallback for d, a, fallback in zip(reached, accepted, overall)]
             for key, (reached, accepted) in bands.items()}
    return lambda b: table.get(batch_band(b), overall)


def measure(checkpoint, batches, k_max, max_new_tokens):
    """(per arm: k = 0..k_max fixed, and "adaptive": --spec-adaptive up to k_max) engine seconds over all
    batches, the fixed arms' StepTimes, and (samples equal to plain's, samples compared)."""
    rows = PROMPTS_PER_BATCH * SAMPLES_PER_PROMPT
    arms = list(range(k_max + 1)) + [ADAPTIVE]
    engines = {}
    for arm in arms:
        k = k_max if arm == ADAPTIVE else arm
        spec = None if k == 0 else {"method": "mtp", "num_speculative_tokens": k, "rejection_sample_method": "strict"}
        engines[arm] = build_engine(checkpoint, spec, EngineConfig(max_batch_size=rows), adaptive=arm == ADAPTIVE)
        if arm != ADAPTIVE:
            engines[arm].k_policy = StepTimes(k)
    seconds = dict.fromkeys(arms, 0.0)
    same = total = 0
    for i, prompts in enumerate(batches):
        sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=i)
        order = arms if i % 2 == 0 else arms[::-1]  # drift hits every arm alike
        out = {}
        for arm in order:
            out[arm] = engines[arm].generate(samples_for_prompts(prompts, SAMPLES_PER_PROMPT), sampling)
            seconds[arm] += engines[arm].last_stats["seconds"]
        for arm in arms[1:]:
            same += sum(a.response_ids == b.response_ids for a, b in zip(out[0], out[arm]))
            total += rows
    return seconds, {k: engines[k].k_policy for k in range(k_max + 1)}, (same, total)


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
    step replaced by 1 / E(k) of a k step at the same B."""
    outside = k_seconds - sum(s for _, s in k_steps)
    return outside + sum(curve(b) / expected_tokens(acceptance_at(b), k) for b, _ in plain_steps)


def parse_scenario(text, k_max):
    name, _, rates = text.rpartition("=")
    try:
        values = [float(x) for x in rates.split(",")]
    except ValueError:
        values = []
    require(name and len(values) >= k_max and all(0.0 <= v <= 1.0 for v in values),
            f"--acceptance {text!r}: write NAME=a1,...,a{k_max}, conditional rates in [0, 1], one per draft position")
    return name, values[:k_max]


@exit_on_user_error
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", default="checkpoints/tiny-mimo-longtail")
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tail-rows", type=int, default=8, help="report the plain time spent at <= this many rows")
    p.add_argument("--acceptance", action="append", default=None,
                   help="NAME=a1,...,aK conditional acceptance per position (repeatable)")
    args = p.parse_args(argv)
    k_max = args.num_speculative_tokens
    require(k_max >= 1, f"--num-speculative-tokens must be >= 1 (got {k_max})")
    require(args.threads >= 1, f"--threads must be >= 1 (got {args.threads})")
    require(args.batches >= 1, f"--batches must be >= 1 (got {args.batches})")
    require(os.path.isfile(os.path.join(args.hf_checkpoint, "config.json")),
            f"--hf-checkpoint {args.hf_checkpoint}: no config.json there (give an HF checkpoint directory)")
    scenarios = [parse_scenario(s, k_max) for s in (args.acceptance or DEFAULT_SCENARIOS)]
    torch.set_num_threads(args.threads)
    batches = rollout_batches(args.hf_checkpoint, args.batches)
    seconds, timed, (same, total) = measure(args.hf_checkpoint, batches, k_max, args.max_new_tokens)
    steps = {k: policy.steps for k, policy in timed.items()}
    curves = {k: cost_curve(steps[k]) for k in range(k_max + 1)}
    plain_steps = steps[0]
    rest = seconds[0] - sum(s for _, s in plain_steps)
    tail = sum(s for b, s in plain_steps if b <= args.tail_rows)
    measured = conditional_acceptance(timed[k_max].bands)
    print(f"{args.hf_checkpoint}: {args.batches} long-tail batches of {PROMPTS_PER_BATCH * SAMPLES_PER_PROMPT} "
          f"rows, T = 1, strict verification, {args.threads} thread(s); every arm rolled out plain's responses "
          f"for {same} of {total} samples")
    print(f"plain engine time {seconds[0]:.2f} s: {len(plain_steps)} decode steps, prefill and loop {rest:.2f} s; "
          f"steps at <= {args.tail_rows} rows: {tail / seconds[0]:.0%} of the time")
    print(f"this checkpoint's draft, conditional acceptance by position at k = {k_max}: "
          + " / ".join(f"{a:.2f}" for a in measured))
    print("real engine time against plain (same batches): "
          + ", ".join(f"{'k=' if arm != ADAPTIVE else ''}{arm} {seconds[0] / seconds[arm]:.2f}x" for arm in seconds))
    print_cost_table(curves, PROMPTS_PER_BATCH * SAMPLES_PER_PROMPT)
    measured_at = acceptance_by_band(timed[k_max].bands, measured)
    print("check of the model on what ran, fixed k, predicted / real speedup: " + ", ".join(
        f"k={k} {seconds[0] / predicted_fixed_k(plain_steps, steps[k], seconds[k], curves[k], k, measured_at):.2f}x"
        f" / {seconds[0] / seconds[k]:.2f}x" for k in range(1, k_max + 1)))
    print("\nceiling: an oracle picking the cheapest k per emitted token at every B, costs and acceptance known")
    print("| acceptance (conditional per position) | tokens/verify at k | share of plain steps drafting | "
          f"speedup of the rollout | of its steps at <= {args.tail_rows} rows |")
    print("|---|---|---|---|---|")
    tail_steps = [(b, s) for b, s in plain_steps if b <= args.tail_rows]
    oracle_rows = [("this checkpoint's draft, measured per batch-size band", measured, measured_at)]
    oracle_rows += [(name, acceptance, lambda b, a=acceptance: a) for name, acceptance in scenarios]
    for name, acceptance, acceptance_at in oracle_rows:
        spec_steps, chosen = oracle_time(plain_steps, curves, acceptance_at)
        tail_spec, _ = oracle_time(tail_steps, curves, acceptance_at)
        drafting = sum(1 for k in chosen if k) / max(len(chosen), 1)
        tokens = " / ".join(f"{expected_tokens(acceptance, k):.2f}" for k in range(1, k_max + 1))
        print(f"| {name}: {' / '.join(f'{a:.2f}' for a in acceptance)} | {tokens} | {drafting:.0%} | "
              f"**{seconds[0] / (rest + spec_steps):.2f}x** | {tail / max(tail_spec, 1e-12):.2f}x |", flush=True)


def print_cost_table(curves, max_rows):
    print("\nstep cost against plain at B rows, c_k(B) / c_0(B):")
    grid = [b for b in (1, 2, 4, 8, 16, 32, 64, 96, 128) if b <= max_rows]
    print("| k | " + " | ".join(f"B={b}" for b in grid) + " |")
    print("|---" * (len(grid) + 1) + "|")
    for k in list(curves)[1:]:
        print(f"| {k} | " + " | ".join(f"{curves[k](b) / curves[0](b):.2f}" for b in grid) + " |")


if __name__ == "__main__":
    main()
