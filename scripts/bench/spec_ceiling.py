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
it reports the real `--spec-adaptive` engine on the same batches. The arithmetic lives in
rollout/embedded/spec_ceiling.py.

    python scripts/bench/spec_ceiling.py [--hf-checkpoint checkpoints/tiny-mimo-longtail] [--batches 16]
        [--acceptance "online end=0.70,0.13,0.13" ...]

Strict verification reproduces plain sampling token for token, so every k rolls out the same
responses: the script checks it, and the costs compare the same work.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from vime.errors import exit_on_user_error, require  # noqa: E402

# conditional acceptance per position: every draft accepted, the online draft at the end of the
# 40-step long-tail drift run (0.70 at position 1, 1.79 tokens per verify at k = 2),
# and the best online draft measured (0.88 / 0.66 / 0.53 absolute by position)
DEFAULT_SCENARIOS = ("every draft accepted=1,1,1", "online draft, long-tail drift end=0.70,0.13,0.13",
                     "best online draft=0.88,0.75,0.80")


ADAPTIVE = "adaptive"


def measure(checkpoint, batches, k_max, max_new_tokens):
    """(per arm: k = 0..k_max fixed, and "adaptive": --spec-adaptive up to k_max) engine seconds over all
    batches, the fixed arms' StepTimes, and (samples equal to plain's, samples compared)."""
    from rollout.embedded.engine import EngineConfig
    from rollout.embedded.engine_builder import build_engine
    from rollout.embedded.spec_ceiling import StepTimes
    from rollout.sampling_params import SamplingParams
    from scripts.bench.throughput import PROMPTS_PER_BATCH, SAMPLES_PER_PROMPT
    from vime.sample import samples_for_prompts

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
    run(args, scenarios)  # bad input is refused above, before the engine's imports


def run(args, scenarios):
    """Measure the fixed-k and adaptive engines on the same batches, then print the model's figures."""
    import torch

    from rollout.embedded.spec_ceiling import (acceptance_by_band, conditional_acceptance, cost_curve, oracle_time,
                                               predicted_fixed_k)
    from rollout.embedded.spec_policy import expected_tokens
    from scripts.bench.throughput import PROMPTS_PER_BATCH, SAMPLES_PER_PROMPT, rollout_batches

    k_max = args.num_speculative_tokens
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
