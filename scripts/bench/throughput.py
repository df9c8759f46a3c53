#!/usr/bin/env python
"""Rollout throughput: tokens/s of the embedded engine against other engines and against itself
with speculation, timed by one harness.

    python scripts/bench/throughput.py vs-hf [--hf-checkpoint DIR]        # engine vs transformers generate
    python scripts/bench/throughput.py vs-vllm [--hf-checkpoint DIR]      # embedded vs vLLM backend, plain and MTP
    python scripts/bench/throughput.py spec-decode [--methods "none,mtp k=2"]   # speculative methods vs none
    python scripts/bench/throughput.py spec-decode --hf-checkpoint TARGET --dflash-drafts D4,D8 --methods "none,dflash k=7"
    python scripts/bench/throughput.py spec-decode --hf-checkpoint TARGET --dspark-drafts D3 --methods "none,dspark k=3 sized"
    python scripts/bench/throughput.py spec-scale [--device cuda --dtype bfloat16]  # synthetic acceptance, big model
    python scripts/bench/throughput.py compaction                          # slot compaction on / off
    python scripts/bench/throughput.py repeatability                       # how steady this machine times the same work
    python scripts/bench/throughput.py step-limit [--device cuda --dtype bfloat16 --layers 24 --hidden 2048 --intermediate 5632]
                                                                           # a decode step vs the bandwidth limit
    python scripts/bench/throughput.py gemm-rows [--out 8192 --in 4096]   # one weight's GEMM against its rows

The harness times every side on the same prompts, sides interleaved within each repeat (load from
other jobs hits all alike), best of --repeats, after a warm-up; a ratio is printed only after
checking both sides did the same work (as many tokens; greedy: the same tokens). Without
--hf-checkpoint, vs-hf and vs-vllm make a random-weight tiny model (speed does not depend on the
weights; acceptance does). `MODE --help` says what each prints.
"""
import argparse
import math
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from rollout.embedded.engine import EngineConfig  # noqa: E402
from rollout.embedded.engine_builder import build_engine, build_proposer  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from vime.spec_config import parse_spec_config  # noqa: E402
from rollout.spec_stats import aggregate_spec_stats, spec_rates  # noqa: E402
from rollout.chat_arithmetic import CHAT_TASKS  # noqa: E402
from rollout.task import DEFAULT_TASK_VARIANT, TASK_VARIANTS, make_prompts, prompt_tasks  # noqa: E402
from rollout.tiny_model import make_random_checkpoint  # noqa: E402
from rollout.tokenizer import TextCodec  # noqa: E402
from vime.models.draft_kinds import DRAFT_KINDS  # noqa: E402
from vime.errors import exit_on_user_error, require  # noqa: E402
from vime.sample import Sample, samples_for_prompts  # noqa: E402

PROMPTS_PER_BATCH, SAMPLES_PER_PROMPT = 16, 8  # a GRPO rollout batch of the long-tail task


# ------------------------------------------------------------------ the harness
def mismatch(a, b, greedy):
    """Why two lists of responses (token-id lists) are not the same work, or None when they are."""
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} requests"
    counts_a, counts_b = sum(map(len, a)), sum(map(len, b))
    if counts_a != counts_b:
        return f"{counts_a} vs {counts_b} generated tokens"
    for i, (x, y) in enumerate(zip(a, b)):
        if greedy and x != y:
            at = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return f"greedy request {i} differs at token {at}"
    return None


def require_same_work(label, a, b, greedy):
    """Exit (status 1) with one line unless responses `a` and `b` are the same work: a tokens/s
    ratio of unequal work (or of greedy runs that diverged) measures different text."""
    why = mismatch(a, b, greedy)
    if why is not None:
        print(f"error: {label}: the two sides did different work ({why}); no ratio printed", file=sys.stderr)
        sys.exit(1)


def responses(samples):
    return [list(s.response_ids) for s in samples]


# --clock: wall seconds, or this process's CPU seconds (with one thread and the engine on the CPU, what
# a quiet machine's wall clock shows; a shared machine's other jobs do not count in it)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


MAX_REPEATS = 50  # --min-seconds stops adding repeats here


def time_interleaved(runs, repeats, clock="wall", min_seconds=0.0, rates=None, seconds=None):
    """{name: (best tokens/s, samples of the last repeat)}: each run (a callable returning samples)
    once per repeat, runs interleaved so a busy machine slows every one alike, their order rotated at
    each repeat (a DSpark engine timed second, after plain decoding, ran 7-12% below an engine doing the
    same work timed third, and ran level with it when their places swapped); at least `repeats`
    repeats, more (up to MAX_REPEATS) until every run has been timed for `min_seconds` in all (a
    short run's best of a few is as noisy as the machine). A run's `prepare` (if it has one) is called first, off the clock.
    A run with `slices` (callables, each returning its part of the samples) is timed slice by slice, the runs
    interleaved at every slice and their order rotated at each: a repeat's rate is its slices' tokens over
    their seconds, and runs seconds apart share more of the machine's speed than runs a whole run apart.
    `rates` (a dict), if given, gets every run's tokens/s of each repeat, in order (for `paired_median`), and
    `seconds` every run's seconds of each repeat."""
    best, last, spent = {}, {}, dict.fromkeys(runs, 0.0)
    now = CLOCKS[clock]
    names, done = list(runs), 0
    slices = {name: getattr(run, "slices", [run]) for name, run in runs.items()}
    rounds = max(len(s) for s in slices.values())
    while done < repeats or (min(spent.values()) < min_seconds and done < MAX_REPEATS):
        took, samples = dict.fromkeys(names, 0.0), {name: [] for name in names}
        for name in names:
            getattr(runs[name], "prepare", lambda: None)()
        for j in range(rounds):
            shift = (done + j) % len(names)
            for name in names[shift:] + names[:shift]:
                if j < len(slices[name]):
                    start = now()
                    samples[name] += slices[name][j]()
                    took[name] += now() - start
        for name in names:
            spent[name] += took[name]
            rate = sum(len(s.response_ids) for s in samples[name]) / took[name]
            best[name], last[name] = max(best.get(name, 0.0), rate), samples[name]
            if rates is not None:
                rates.setdefault(name, []).append(rate)
            if seconds is not None:
                seconds.setdefault(name, []).append(took[name])
        done += 1
    return {name: (best[name], last[name]) for name in runs}


def paired_median(rates, base):
    """{name: the median over repeats of its tokens/s over `base`'s in the same repeat}. Why beside the
    best of each: a shared CPU's speed moves between runs half a second apart, so the best of one method
    and the best of another can come from different moments; a repeat's runs are adjacent in time, and the
    median drops the repeats a burst of load hit."""
    return {name: statistics.median(r / b for r, b in zip(rs, rates[base])) for name, rs in rates.items()}


def head_to_head(rates, first, second):
    """(the median over repeats of `first`'s tokens/s over `second`'s in the same repeat, the repeats where
    `first` was faster, the repeats, the two-sided sign test's p-value that either is faster as often as not).
    Why a sign test: it asks only which of two adjacent runs was faster, so a burst of load that hit one repeat
    counts as one repeat, whatever it did to the rates."""
    n, wins = len(rates[first]), sum(a > b for a, b in zip(rates[first], rates[second]))
    tail = sum(math.comb(n, i) for i in range(min(wins, n - wins) + 1)) / 2 ** n
    return paired_median(rates, second)[first], wins, n, min(1.0, 2 * tail)


def generator(engine, prompts, sampling, n=1):
    """A run for time_interleaved: `engine` (anything with generate(samples, sampling)) on the prompts."""
    return lambda: engine.generate(samples_for_prompts(prompts, n), sampling)


def greedy(max_new_tokens):
    # fixed-length responses (EOS ignored): every side generates the same number of tokens
    return SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)


def checkpoint_or_random(path):
    """The given HF checkpoint, else a random tiny MiMo made in a temp dir."""
    if path:
        require(os.path.isdir(path), f"--hf-checkpoint {path}: no such directory (leave it out for a random tiny model)")
        return path
    path = tempfile.mkdtemp()
    make_random_checkpoint(path)
    return path


def task_prompts(path, n, variant=None):
    """n prompts as token ids: the tiny addition task's (seed 11) without `variant`, else `variant_prompts`."""
    if variant is not None:
        return variant_prompts(path, variant, n)
    codec = TextCodec(path)
    return [codec.encode_prompt(r["prompt"], 1) for r in make_prompts(n, seed=11)]


def context_for(prompts, max_new_tokens):
    """An engine's KV-cache length for `prompts` and their responses (a real model's own context runs to
    thousands of positions, which a cache of many rows could not hold)."""
    return max(map(len, prompts)) + max_new_tokens + 8  # room for a verify's drafts past the last token


def batch_sizes(text):
    return [int(b) for b in text.split(",")]


# ------------------------------------------------------------------ vs-hf
def hf_generator(path, prompts, max_new_tokens):
    """A run of transformers' `generate` (SDPA, left padding, EOS ignored) returning Samples."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # EOS ignored, as on the engine's side
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()

    def run():
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        return [Sample(prompt_ids=p, response_ids=r) for p, r in zip(prompts, out[:, width:].tolist())]
    return run


def vs_hf(args):
    """Greedy tokens/s of the embedded engine and of transformers `generate` per batch size, and the ratio."""
    path = checkpoint_or_random(args.hf_checkpoint)
    print(f"{'batch':>5} {'engine tok/s':>13} {'HF tok/s':>10} {'ratio':>7}")
    for bs in batch_sizes(args.batch_sizes):
        prompts = task_prompts(path, bs, args.task_variant)
        engine = build_engine(path, None, EngineConfig(max_batch_size=bs,
                                                       max_len=context_for(prompts, args.max_new_tokens)))
        runs = {"engine": generator(engine, prompts, greedy(args.max_new_tokens)),
                "hf": hf_generator(path, prompts, args.max_new_tokens)}
        for run in runs.values():
            run()  # warm-up
        got = time_interleaved(runs, args.repeats)
        require_same_work(f"batch {bs}", responses(got["engine"][1]), responses(got["hf"][1]), greedy=True)
        print(f"{bs:>5} {got['engine'][0]:>13.1f} {got['hf'][0]:>10.1f} {got['engine'][0] / got['hf'][0]:>6.2f}x")


# ------------------------------------------------------------------ vs-vllm
VLLM_ARMS = {"plain": None, "mtp k=1": {"method": "mtp", "num_speculative_tokens": 1},
             "mtp k=2": {"method": "mtp", "num_speculative_tokens": 2}}


def backend_rates(names, path, spec, prompt_sets, args):
    """{batch size: {backend: (tokens/s, spec rates, samples)}} of the rollout backends `names`, alive
    together and timed interleaved at each batch size (a busy machine slows both alike; an idle
    backend holds no core), closed afterwards."""
    from rollout.backend import build_backend

    backends = {}
    try:
        for name in names:
            backends[name] = build_backend(name, path, spec, max(prompt_sets), context_len=context_for(
                [p for prompts in prompt_sets.values() for p in prompts], args.max_new_tokens))
        out = {}
        for bs, prompts in prompt_sets.items():
            for backend in backends.values():
                backend.generate(samples_for_prompts(prompts[:2]), greedy(args.max_new_tokens))  # warm-up
            timed = time_interleaved({name: generator(backend, prompts, greedy(args.max_new_tokens))
                                      for name, backend in backends.items()}, args.repeats)
            # each backend's stats are those of its last timed call
            out[bs] = {name: (rate, spec_rates(backends[name].stats()["spec"]), samples)
                       for name, (rate, samples) in timed.items()}
        return out
    finally:
        for backend in backends.values():
            backend.close()


def vs_vllm(args):
    """Per arm (plain, MTP k = 1, 2) and batch size, greedy: tokens/s of the embedded backend and the
    vLLM backend (rollout/backend.py, as train_rl.py runs them), the ratio, and each side's
    acceptance rate and length (one definition for both), the two interleaved. vLLM's start-up is not timed."""
    path = checkpoint_or_random(args.hf_checkpoint)
    prompt_sets = {bs: task_prompts(path, bs, args.task_variant) for bs in batch_sizes(args.batch_sizes)}
    print(f"{'arm':>8} {'batch':>5} {'embedded tok/s':>15} {'vLLM tok/s':>11} {'ratio':>7} "
          f"{'accept emb':>11} {'accept vLLM':>12} {'length emb':>11} {'length vLLM':>12}", flush=True)
    for arm in args.arms.split(","):
        rates = backend_rates(("embedded", "vllm"), path, VLLM_ARMS[arm], prompt_sets, args)
        for bs in prompt_sets:
            (a, st_a, out_a), (b, st_b, out_b) = rates[bs]["embedded"], rates[bs]["vllm"]
            require_same_work(f"{arm} at batch {bs}", responses(out_a), responses(out_b), greedy=True)
            print(f"{arm:>8} {bs:>5} {a:>15.1f} {b:>11.1f} {a / b:>6.2f}x {st_a['spec_accept_rate']:>11.3f} "
                  f"{st_b['spec_accept_rate']:>12.3f} {st_a['spec_accept_length']:>11.3f} "
                  f"{st_b['spec_accept_length']:>12.3f}", flush=True)


# ------------------------------------------------------------------ spec-decode
def spec_methods(draft, rejection):
    table = {
        "none": None,
        "mtp k=1": {"method": "mtp", "num_speculative_tokens": 1},
        "mtp k=2": {"method": "mtp", "num_speculative_tokens": 2},
        "mtp k=3": {"method": "mtp", "num_speculative_tokens": 3},
        "mtp adaptive": {"method": "mtp", "num_speculative_tokens": 3},
        "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        "suffix k=3": {"method": "suffix", "num_speculative_tokens": 3},
        "draft_model k=3": {"method": "draft_model", "num_speculative_tokens": 3, "model": draft},
    }
    return {name: spec and dict(spec, rejection_sample_method=rejection) for name, spec in table.items()}


# block draft kind -> the ways the benchmark runs it: name suffix -> extra spec keys
# ' idle': the draft attached but a schedule of k = 0 at every batch size (what a step without drafts costs)
IDLE = {"num_speculative_tokens_per_batch_size": [[1, 1, 0]]}
BLOCK_KINDS = {"dflash": {"": {}, " adaptive": {}, " idle": IDLE},
               "dspark": {"": {}, " adaptive": {}, " sized": {"enable_adaptive_verification": True}, " idle": IDLE}}


def block_methods(kind, drafts):
    """'KIND k=K' and its variants (' adaptive': --spec-adaptive; DSpark's ' sized': verification sized by
    confidence; ' idle': drafting nothing) per draft directory of a block kind (K: the drafts of its block)."""
    variants = BLOCK_KINDS[kind]
    table = {}
    for path in drafts:
        require(os.path.isfile(os.path.join(path, "config.json")),
                f"--{kind}-drafts {path}: not a draft directory (make one with scripts/make_{kind}_draft.py)")
        k = DRAFT_KINDS[kind].read_config(path).num_drafts
        for suffix, extra in variants.items():
            table[f"{kind} k={k}{suffix}"] = {"method": kind, "num_speculative_tokens": k, "model": path, **extra}
    return table


POOL_PER_PROMPT = 64  # --min-response-len picks its prompts from this many times --num-prompts
ADAPTIVE = {"mtp adaptive"}  # methods run with --spec-adaptive (and every "... adaptive" one of a draft directory)
EAGLE3_KS = (1, 2, 3, 4)  # an EAGLE-3 draft chains any k: the fixed ks timed, the largest also adaptive


def eagle3_methods(path):
    """'eagle3 k=K' for each of EAGLE3_KS and 'eagle3 adaptive' (--spec-adaptive up to the largest) of one
    EAGLE-3 draft directory of the checkpoint (None: no methods)."""
    if path is None:
        return {}
    require(os.path.isfile(os.path.join(path, "config.json")),
            f"--eagle3-draft {path}: not a draft directory (make one with scripts/make_eagle3_draft.py)")
    spec = {"method": "eagle3", "model": path}
    table = {f"eagle3 k={k}": dict(spec, num_speculative_tokens=k) for k in EAGLE3_KS}
    return {**table, "eagle3 adaptive": dict(spec, num_speculative_tokens=max(EAGLE3_KS))}


def variant_prompts(checkpoint, variant, n):
    """n prompts of a task (the same seed everywhere) as token ids: a tiny-task variant's text after BOS, a chat
    task's messages through the checkpoint's chat template."""
    codec, rows = TextCodec(checkpoint), prompt_tasks()[variant].prompts(n, seed=1234)
    if variant in CHAT_TASKS:
        return [codec.chat_prompt_ids(r[CHAT_TASKS[variant].input_key]) for r in rows]
    return [[1] + codec.encode(r["prompt"]) for r in rows]


def proposer_run(engine, spec, prompts, sampling, indices=None, slices=1):
    """A run of `prompts` on the engine's proposer, kept across repeats as an engine keeps it across
    generates (a draft's buffers are allocated and touched once); one that remembers earlier outputs gets a
    fresh one at each `prepare`, off the clock (suffix decoding would replay the previous repeat). The k
    policy is kept: an adaptive engine keeps its profile and acceptance. With `slices` > 1 the run is that
    many generates, each of consecutive prompts (`time_interleaved` times them slice by slice)."""
    indices = list(indices or range(len(prompts)))
    bounds = [len(prompts) * j // slices for j in range(slices + 1)]

    def part(lo, hi):
        def generate():
            samples = engine.generate(indexed_samples(prompts[lo:hi], indices[lo:hi]), sampling)
            stats = engine.stats()
            run.k_means.append(stats.get("spec_k_mean"))
            run.prefills.append((stats["generated_tokens"] - len(samples), stats["prefill_seconds"]))
            return samples
        return generate

    def run():
        return [s for generate in run.slices for s in generate()]

    def prepare():
        if engine.proposer.remembers_outputs:
            engine.set_proposer(build_proposer(parse_spec_config(spec) if spec is not None else None), engine.k_policy)
    run.prepare, run.k_means = prepare, []  # k_means: each generate's row-weighted mean k (a k policy that reports it)
    run.prefills = []  # each generate's (tokens after each response's first, seconds of the target's prefills)
    run.slices = [part(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    return run


def decode_rates(run, seconds):
    """Per repeat of a `proposer_run` timed for `seconds` (a list, one per repeat), the decode phase's tokens/s:
    the tokens after each response's first over the seconds outside the target's prompt forwards, as vLLM's
    time per output token leaves out the time to the first. The prompt forwards are the same work on every
    side of a ratio; the proposer's pass over a prompt is drafting and stays on the clock."""
    per_repeat = len(run.slices)
    parts = [run.prefills[i * per_repeat:(i + 1) * per_repeat] for i in range(len(seconds))]
    return [sum(t for t, _ in part) / (took - sum(p for _, p in part)) for part, took in zip(parts, seconds)]


def indexed_samples(prompts, indices=None):
    """Fresh Samples of `prompts` with the given prompt indices (default 0..): a request's random
    stream follows its index, so a prompt keeps its draws when picked out of a larger set."""
    return [Sample(prompt_ids=list(p), index=i) for p, i in zip(prompts, indices or range(len(prompts)))]


def long_responses(checkpoint, prompts, sampling, n, min_len, device="cpu"):
    """(prompts, their indices) of the first n requests whose plain response under `sampling` (on `device`, as the
    timed runs decode) has at least min_len tokens: the rows still running at a rollout's drained end."""
    config = EngineConfig(max_batch_size=len(prompts), device=device, max_len=context_for(prompts, sampling.max_new_tokens))
    plain = build_engine(checkpoint, None, config).generate(
        indexed_samples(prompts), sampling)
    kept = [(p, s.index) for p, s in zip(prompts, plain) if len(s.response_ids) >= min_len][:n]
    require(len(kept) == n, f"--min-response-len {min_len}: only {len(kept)} of {len(prompts)} requests give a "
            "response that long; lower it or --num-prompts")
    return [p for p, _ in kept], [i for _, i in kept]


def spec_decode(args):
    """Per batch size and method (none, mtp k=1..3, mtp adaptive, ngram, suffix, draft_model; DFlash, DSpark and
    EAGLE-3 drafts given by directory):
    tokens/s, speedup against the first method (best against best), the decode phase's speedup (`decode_rates`:
    the prompts' prefill left out), tokens per verify, acceptance rate and per position, and the paired speedup
    (`paired_median`);
    the adaptive method against the best fixed k; with --versus, one method head to head with another (`head_to_head`)."""
    require(args.min_seconds >= 0, f"--min-seconds {args.min_seconds}: give 0 (just --repeats) or more")
    require_device(args.device)
    pool = args.num_prompts * (POOL_PER_PROMPT if args.min_response_len else 1)
    prompts = variant_prompts(args.hf_checkpoint, args.task_variant, pool)
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                              ignore_eos=not args.stop_at_eos, seed=1234)  # the same draws on every side
    indices = None
    if args.min_response_len:
        prompts, indices = long_responses(args.hf_checkpoint, prompts, sampling, args.num_prompts, args.min_response_len,
                                          args.device)
    table = spec_methods(args.draft_model or args.hf_checkpoint, args.rejection_sample_method)
    for kind in BLOCK_KINDS:
        drafts = getattr(args, f"{kind}_drafts")
        table.update({name: dict(spec, rejection_sample_method=args.rejection_sample_method)
                      for name, spec in block_methods(kind, drafts.split(",") if drafts else []).items()})
    table.update({name: dict(spec, rejection_sample_method=args.rejection_sample_method)
                  for name, spec in eagle3_methods(args.eagle3_draft).items()})
    adaptive = ADAPTIVE | {name for name in table if name.endswith(" adaptive")}
    wanted = args.methods.split(",") if args.methods else list(table)
    require(all(name in table for name in wanted), f"--methods {args.methods!r}: choose from {', '.join(table)}")
    pairs = versus_pairs(args.versus, wanted)
    sizes = batch_sizes(args.batch_sizes)
    require(args.slices >= 1 and args.num_prompts >= args.slices * max(sizes),
            f"--slices {args.slices}: give 1 or more, and no more than --num-prompts over the largest batch size "
            f"({args.num_prompts // max(sizes)}): a slice with fewer prompts than rows would time a smaller batch")
    print(f"checkpoint {args.hf_checkpoint} on {args.device}, temperature {args.temperature}, "
          f"{args.num_prompts} prompts, "
          f"{'up to ' if args.stop_at_eos else ''}{args.max_new_tokens} new tokens"
          f"{', stop at EOS' if args.stop_at_eos else ''}"
          f"{f', plain responses >= {args.min_response_len} tokens' if args.min_response_len else ''}, "
          f"best of {args.repeats}{f' (or more, {args.min_seconds:g} s a method)' if args.min_seconds else ''} "
          f"(methods interleaved{f' in {args.slices} slices of the prompts' if args.slices > 1 else ''}, their order "
          f"rotated), {args.clock} clock")
    print("| batch | method | tokens/s | speedup | decode speedup | tokens/verify | accept rate | per position "
          "| paired speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in sizes:
        engines = {name: build_engine(args.hf_checkpoint, table[name],
                                      EngineConfig(max_batch_size=batch, device=args.device,
                                                   max_len=context_for(prompts, args.max_new_tokens)),
                                      adaptive=name in adaptive) for name in wanted}
        for engine in engines.values():
            engine.generate(samples_for_prompts(prompts[:batch]), sampling)  # warm-up (and the adaptive profile)
        rates, seconds = {}, {}
        runs = {name: proposer_run(engines[name], table[name], prompts, sampling, indices, args.slices)
                for name in wanted}
        got = time_interleaved(runs, args.repeats, args.clock, args.min_seconds, rates, seconds)
        # the engine clocks its prefills on the wall clock: under --clock cpu the decode phase is not measured
        decode = {name: max(decode_rates(runs[name], seconds[name])) if args.clock == "wall" else math.nan
                  for name in wanted}
        paired = paired_median(rates, wanted[0])
        for name in wanted[1:]:
            require_same_work(f"{name} vs {wanted[0]} at batch {batch}", responses(got[name][1]),
                              responses(got[wanted[0]][1]), greedy=args.temperature == 0)
        base = got[wanted[0]][0]
        for name in wanted:
            rate, samples = got[name]
            st = aggregate_spec_stats(samples)
            pos = " / ".join(f"{st[k]:.2f}" for k in sorted(st) if k.startswith("spec_accept_rate_pos_"))
            decode_ratio = decode[name] / decode[wanted[0]]
            print(f"| {batch} | {name} | {rate:.0f} | {rate / base:.2f}x | "
                  f"{'-' if math.isnan(decode_ratio) else f'{decode_ratio:.2f}x'} | "
                  f"{st['spec_accept_length']:.2f} | "
                  f"{st['spec_accept_rate']:.2f} | {pos or '-'} | {paired[name]:.2f}x |", flush=True)
        for name in [n for n in wanted if n in adaptive or n.endswith(" sized")]:
            ks = [k for k in runs[name].k_means if k is not None]
            print(f"batch {batch}: {name} drafted k = {statistics.mean(ks) if ks else float('nan'):.2f} on average over "
                  f"{len(ks)} generates, {min(ks, default=float('nan')):.2f}-{max(ks, default=float('nan')):.2f} per generate",
                  flush=True)
        for first, second in pairs:
            ratio, wins, n, p = head_to_head(rates, first, second)
            print(f"batch {batch}: {first} / {second} paired {ratio:.2f}x, faster in {wins} of {n} repeats "
                  f"(sign test p = {p:.3g})", flush=True)
        if args.costs:
            in_run = {name: aggregate_spec_stats(got[name][1])["spec_accept_length"] * decode[wanted[0]] / decode[name]
                      for name in wanted}
            print_costs(engines, table, batch, round(statistics.mean(len(p) for p in prompts)), in_run)
        for name in [n for n in wanted if n in adaptive]:
            best = max(fixed_k_of(name, got), key=lambda n: got[n][0])
            print(f"batch {batch}: {name} / best fixed k ({best}) = {got[name][0] / got[best][0]:.3f}", flush=True)


def print_costs(engines, table, batch, prompt_len, in_run, repeats=5):
    """The profile behind the speedups at `batch` rows (best of `repeats`, after the timed runs): a plain
    step (one token a row), a prefill of a prompt of the mean length, and per drafting method at its k a
    verify of k + 1 tokens a row and a drafting of k tokens, against the plain step; then what a drafting
    step cost in the timed runs (`in_run`: tokens per verify over the decode speedup, in plain decode steps),
    host work and the draft's pass over accepted tokens included, which the probes leave out."""
    first = next(iter(engines.values()))
    step = first.profile_verify(batch, 1, repeats=repeats)
    prefill = first.profile_verify(batch, prompt_len, context=0, repeats=repeats)
    print(f"batch {batch}: a plain step {1e3 * step:.1f} ms; a prefill of {prompt_len} tokens {prefill / step:.2f}x it",
          flush=True)
    for name, engine in engines.items():
        k = (table[name] or {}).get("num_speculative_tokens", 0)
        if k:
            verify = engine.profile_verify(batch, k + 1, repeats=repeats)
            drafting = (f"drafting {k} {engine.profile_draft(batch, k, repeats) / step:.2f}x"
                        if hasattr(engine.proposer, "profile_draft") else "its drafting not profiled")
            timed = ("" if math.isnan(in_run[name])
                     else f"; in the timed runs a drafting step cost {in_run[name]:.2f}x a plain one")
            print(f"batch {batch}: {name}: a verify of {k + 1} tokens {verify / step:.2f}x a plain step, "
                  f"{drafting}{timed}", flush=True)


def fixed_k_of(adaptive_name, methods):
    """The methods an adaptive one is compared with: none and its own draft at each fixed k ('mtp adaptive':
    'mtp k=1', ...; 'dflash k=3 adaptive': 'dflash k=3')."""
    kind = adaptive_name.removesuffix(" adaptive")
    if " k=" in kind:  # a block draft's: its k is the block's
        return [n for n in methods if n in ("none", kind)]
    return [n for n in methods if n == "none" or (n.startswith(kind + " k=") and n[len(kind) + 3:].isdigit())]


def versus_pairs(versus, wanted):
    """[(first, second)] of --versus 'A/B,C/D', each a pair of --methods."""
    pairs = [tuple(pair.split("/")) for pair in versus.split(",")] if versus else []
    for pair in pairs:
        require(len(pair) == 2 and all(name in wanted for name in pair),
                f"--versus {versus!r}: give FIRST/SECOND pairs of --methods, comma-separated")
    return pairs


# ------------------------------------------------------------------ spec-scale
# the drift benchmark's end-of-run per-position acceptance (BENCHMARKS.md, online vs frozen, k = 2)
ONLINE_RATES, FROZEN_RATES = "0.79,0.30", "0.077,0.010"
# deep and narrow like real LLMs: the MTP layer is 1/16 of this trunk (DeepSeek-V3 1/61, MiMo-7B 1/36)
SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12,
             num_key_value_heads=6, head_dim=64, max_position_embeddings=512)


def synthetic_spec(rates):
    rates = [float(r) for r in rates.split(",")]
    return {"method": "mtp", "num_speculative_tokens": len(rates), "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": rates}


def spec_scale(args):
    """Speculation where decoding is memory-bound: a random model of the default family (112 M
    parameters by default) decodes fixed-length responses with no speculation and with MTP drafting
    whose acceptance is set by synthetic verification (vLLM's synthetic_acceptance_rates) to the
    frozen and online drafts' rates. Prints the cost of a verify of 1..4 tokens and of drafting
    against a plain step, then per row count tokens/s of none / frozen / online / online adaptive
    and the speedups online/none, online/frozen, adaptive/none. The acceptance is assumed, not
    measured: the figures say what a draft at those rates buys on this device."""
    require_device(args.device)
    dtype = getattr(torch, args.dtype)
    shape = spec_scale_shape(args)
    sizes = batch_sizes(args.batch_sizes)
    online, frozen = synthetic_spec(args.online_rates), synthetic_spec(args.frozen_rates)
    arms = {"none": (None, False), "frozen": (frozen, False), "online": (online, False), "online adaptive": (online, True)}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_random_checkpoint(tmp, **shape)
        config = EngineConfig(max_batch_size=max(sizes), device=args.device, dtype=dtype)
        engines = {name: build_engine(tmp, spec, config, adaptive=adaptive) for name, (spec, adaptive) in arms.items()}
    prompts = [[1] + [3 + (7 * i + j) % 20 for j in range(8)] for i in range(max(sizes))]
    for engine in engines.values():  # warm-up, and the adaptive arm's cost profile, outside the timing
        engine.generate(samples_for_prompts(prompts), greedy(4))
    params = sum(p.numel() for p in engines["none"].model.parameters())
    print(f"random {cfg.num_hidden_layers}-layer model + {cfg.num_nextn_predict_layers} MTP layer, {params / 1e6:.0f} M "
          f"parameters {args.dtype} on {args.device}; synthetic acceptance online {args.online_rates}, frozen "
          f"{args.frozen_rates}; {args.max_new_tokens} new tokens per row, greedy, EOS off")
    engines["none"].graph_query_windows(4)  # its verify probes run as a speculative engine's verifies do
    ms = [1e3 * engines["none"].profile_verify(1, q, repeats=5) for q in range(1, 5)]
    print("verify forward at 1 row, 1..4 tokens: " + " / ".join(f"{t:.1f}" for t in ms) + " ms = "
          + " / ".join(f"{t / ms[0]:.2f}x" for t in ms) + " a plain step")
    k = len(args.online_rates.split(","))
    draft_ms = 1e3 * engines["online"].profile_draft(1, k, repeats=5)
    print(f"drafting {k} tokens at 1 row: {draft_ms:.1f} ms = {draft_ms / ms[0]:.2f}x a plain step")
    names = list(engines)
    print(f"{'rows':>4} " + " ".join(f"{n + ' tok/s':>20}" for n in names)
          + f" {'online/none':>12} {'online/frozen':>14} {'adaptive/none':>14} {'adaptive k':>11}")
    for b in sizes:
        got = time_interleaved({n: generator(engines[n], prompts[:b], greedy(args.max_new_tokens)) for n in names},
                               args.repeats)
        for name in names[1:]:  # synthetic acceptance keeps wrong drafts: equal counts, not equal tokens
            require_same_work(f"{name} vs none at {b} rows", responses(got[name][1]), responses(got["none"][1]), False)
        rate = {n: got[n][0] for n in names}
        k_mean = engines["online adaptive"].stats().get("spec_k_mean", float("nan"))
        print(f"{b:>4} " + " ".join(f"{rate[n]:>20.1f}" for n in names)
              + f" {rate['online'] / rate['none']:>11.2f}x {rate['online'] / rate['frozen']:>13.2f}x"
              f" {rate['online adaptive'] / rate['none']:>13.2f}x {k_mean:>11.2f}")


# ------------------------------------------------------------------ step-limit
def spec_scale_shape(args):
    """The random model of spec-scale's shape arguments (heads of 64 channels, half as many KV heads)."""
    heads = args.hidden // SHAPE["head_dim"]
    return dict(SHAPE, num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_attention_heads=heads, num_key_value_heads=heads // 2)


def require_device(device):
    """Whether `device` is CUDA; refused in one line unless it is cpu, or cuda where torch sees a CUDA device."""
    kind = device.split(":")[0]
    require(kind in ("cpu", "cuda"), f"--device {device}: give cpu or cuda")
    require(kind == "cpu" or torch.cuda.is_available(), f"--device {device}: this machine has no CUDA device")
    return kind == "cuda"


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_probes(device, dtype, nbytes):
    """Timed probes of the device's bandwidth, each returning its bytes over its seconds: `copy`, a
    plain tensor copy (each byte read once and written once, both counted: the limit a streaming
    step is held to, as vLLM's and SGLang's published shares are); `read`, a sum (each byte read
    once, what a step that only reads its weights could reach)."""
    src = torch.ones(nbytes * 8 // torch.finfo(dtype).bits, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    return {"copy": (lambda: dst.copy_(src), 2 * nbytes), "read": (lambda: src.sum(dtype=torch.float32), nbytes)}


def decode_weight_bytes(model):
    """Bytes of the weights one plain decode step reads: every trunk layer, the final norm and the
    LM head (the embedding is gathered a row per token; the MTP layers are the drafter's)."""
    n = model.cfg.num_hidden_layers
    read = [p for name, p in model.named_parameters()
            if any(name.startswith(f"model.layers.{i}.") for i in range(n)) or name == "model.norm.weight"]
    return sum(p.numel() * p.element_size() for p in read + [model.head_weight()])


STEP_ARMS = {"eager": dict(enforce_eager=True), "graphed": {}, "compiled + graphed": dict(compile_steps=True)}


def step_limit(args):
    """A decode step against the device's bandwidth limit: the device's copy bandwidth (measured
    here; its read bandwidth beside it), the bytes of weights a plain decode step reads, and per arm
    (eager; on CUDA also graphed and, with --compile, torch.compile + graphed) the step's time at 1
    row back to back (the device's time per step), its share of the limit (weight bytes / copy
    bandwidth / step time; and of the read bandwidth's), a verify of 2 / 3 / 4 tokens against a plain step, and the engine's own
    time per token decoding one row (host work, verification and sampling included) with its share of
    the limit; then eager / graphed. Every quantity is measured once per round, rounds interleave
    them all (load from other jobs hits each alike), best of --repeats rounds. The model: a random one of the
    shape arguments, or --hf-checkpoint's (a real model's weights; the shape arguments then unused)."""
    dtype = getattr(torch, args.dtype)
    cuda = require_device(args.device)
    require(cuda or not args.compile, "--compile: the torch.compile + graphed arm needs --device cuda")
    arms = [a for a in STEP_ARMS if a == "eager" or (cuda and (a == "graphed" or args.compile))]
    prompt = [[1] + [3 + j % 20 for j in range(8)]]
    context = context_for(prompt, max(args.max_new_tokens, 32 + 4))  # the verify probes read 32 positions
    with tempfile.TemporaryDirectory() as tmp:
        path = args.hf_checkpoint or tmp
        if not args.hf_checkpoint:
            make_random_checkpoint(tmp, **spec_scale_shape(args))
        engines = {arm: build_engine(path, None, EngineConfig(max_batch_size=1, device=args.device, dtype=dtype,
                                                              max_len=context, **STEP_ARMS[arm])) for arm in arms}
        cfg = engines["eager"].cfg
    probes = {name: (lambda fn=fn: timed_seconds(fn, args.device), nbytes)
              for name, (fn, nbytes) in bandwidth_probes(args.device, dtype, args.copy_mib << 20).items()}
    for arm, engine in engines.items():  # warm-up (and graph capture) outside the timing
        engine.graph_query_windows(4)  # the verify probes' windows run as a k = 3 engine runs them
        engine.generate(samples_for_prompts(prompt), greedy(4))
        for q in range(1, 5):
            probes[(arm, q)] = (lambda e=engine, q=q: args.steps * e.profile_verify(
                1, q, context=32, repeats=1, back_to_back=args.steps), args.steps)
        probes[(arm, "engine")] = (lambda e=engine: timed_seconds(
            lambda: e.generate(samples_for_prompts(prompt), greedy(args.max_new_tokens)), args.device),
            args.max_new_tokens)
    best = interleaved({name: probe for name, (probe, _) in probes.items()}, args.repeats)
    per_unit = {name: best[name] / units for name, (_, units) in probes.items()}  # seconds per byte, step, token
    weights = decode_weight_bytes(engines["eager"].model)
    limit = weights * per_unit["copy"]
    print(f"{args.hf_checkpoint or 'random'} {cfg.num_hidden_layers}-layer model, hidden {cfg.hidden_size}, "
          f"{args.dtype} on {args.device}: "
          f"{weights / 1e9:.3f} GB of weights a decode step reads; copy bandwidth {1e-9 / per_unit['copy']:.1f} GB/s "
          f"(read + write), the limit {1e3 * limit:.3f} ms a step; read bandwidth (a sum) "
          f"{1e-9 / per_unit['read']:.1f} GB/s, {1e3 * weights * per_unit['read']:.3f} ms a step")
    read_limit = weights * per_unit["read"]
    print(f"{'arm':>20} {'step ms':>9} {'of limit':>9} {'of read':>8} {'verify 2 / 3 / 4 tokens vs plain':>34} "
          f"{'engine ms/token':>16} {'of limit':>9}")
    for arm in arms:
        ms = [1e3 * per_unit[(arm, q)] for q in range(1, 5)]
        per_token = 1e3 * per_unit[(arm, "engine")]
        print(f"{arm:>20} {ms[0]:>9.3f} {1e3 * limit / ms[0]:>8.1%} {1e3 * read_limit / ms[0]:>7.1%} "
              f"{' / '.join(f'{t / ms[0]:.2f}x' for t in ms[1:]):>34} {per_token:>16.3f} {1e3 * limit / per_token:>8.1%}")
    for arm in arms[1:]:
        print(f"eager / {arm} step time: {per_unit[('eager', 1)] / per_unit[(arm, 1)]:.2f}x")


def timed_seconds(fn, device):
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def interleaved(probes, repeats):
    """{name: best seconds} of each probe () -> seconds, every probe once per round."""
    best = dict.fromkeys(probes, float("inf"))
    for _ in range(repeats):
        for name, probe in probes.items():
            best[name] = min(best[name], probe())
    return best


# ------------------------------------------------------------------ compaction
def rollout_batches(checkpoint, n):
    """n long-tail rollout batches of PROMPTS_PER_BATCH prompt id lists (they drain to stragglers)."""
    codec = TextCodec(checkpoint)
    rows = TASK_VARIANTS["longtail"].prompts(PROMPTS_PER_BATCH * n, seed=7)
    ids = [codec.encode_prompt(r["prompt"], 1) for r in rows]
    return [ids[i * PROMPTS_PER_BATCH:(i + 1) * PROMPTS_PER_BATCH] for i in range(n)]


def compaction(args):
    """Engine seconds of the same long-tail batches (16 prompts x 8 samples, T = 1) with slot
    compaction on and off (EngineConfig.compact_slots), interleaved, their ratio, and how many
    responses were the same (all: compaction only moves requests between KV slots)."""
    rows = PROMPTS_PER_BATCH * SAMPLES_PER_PROMPT
    engines = {on: build_engine(args.hf_checkpoint, None, EngineConfig(max_batch_size=rows, compact_slots=on))
               for on in (True, False)}
    seconds, same = {True: 0.0, False: 0.0}, 0
    for i, prompts in enumerate(rollout_batches(args.hf_checkpoint, args.batches)):
        sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=i)
        out = {}
        for on in ((True, False) if i % 2 == 0 else (False, True)):  # drift hits both alike
            out[on] = engines[on].generate(samples_for_prompts(prompts, SAMPLES_PER_PROMPT), sampling)
            seconds[on] += engines[on].last_stats["seconds"]
        same += sum(a.response_ids == b.response_ids for a, b in zip(out[True], out[False]))
    print(f"{args.batches} long-tail batches of {rows} rows, plain decoding")
    print(f"engine seconds: compact {seconds[True]:.3f}, with holes {seconds[False]:.3f}, "
          f"ratio {seconds[True] / seconds[False]:.3f}; same responses {same} of {rows * args.batches}")


def repeatability(args):
    """How steady this machine times the same work: one plain-decoding generate (the same prompts and
    draws every time) run --repeats times back to back, each run's seconds by --clock, and the spread
    (max / min, median / min). A ratio of two methods measured here is good to about that spread of
    their best runs, however many ratios a table prints."""
    for flag in ("num_prompts", "batch_size", "max_new_tokens", "repeats"):  # a count of 0 has no spread
        require(getattr(args, flag) >= 1, f"--{flag.replace('_', '-')} {getattr(args, flag)}: give at least 1")
    prompts = variant_prompts(args.hf_checkpoint, DEFAULT_TASK_VARIANT, args.num_prompts)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=1234)
    engine = build_engine(args.hf_checkpoint, None, EngineConfig(max_batch_size=args.batch_size))
    engine.generate(indexed_samples(prompts[:args.batch_size]), sampling)  # warm-up
    now, seconds = CLOCKS[args.clock], []
    for _ in range(args.repeats):
        start = now()
        engine.generate(indexed_samples(prompts), sampling)
        seconds.append(now() - start)
    ordered = sorted(seconds)
    print(f"{args.hf_checkpoint}: {args.num_prompts} prompts at {args.batch_size} rows, {args.repeats} runs, "
          f"{args.clock} clock: seconds {' '.join(f'{x:.3f}' for x in ordered)}")
    print(f"max / min {ordered[-1] / ordered[0]:.2f}, median / min {ordered[len(ordered) // 2] / ordered[0]:.2f}")


# ------------------------------------------------------------------ gemm-rows
def median_ms(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def gemm_rows(args):
    """GEMM cost against the rows it multiplies: plain `x @ W.t()` against rollout/embedded/linear.py's packed
    backend (oneDNN's kernel itself at every row count; linear.py sends one row on one thread, and few rows of a
    weight under PACKED_MIN_BYTES, to the plain matmul). A verify of 1 + k tokens multiplies every weight by 1 + k rows per
    request, which on a memory-bound step should cost about one row. Prints milliseconds (median of --repeats),
    each backend's cost over its own first row count, and packed over plain per row count (one run)."""
    import dataclasses

    from rollout.embedded.linear import linear, pack, pick_backend

    torch.set_num_threads(args.threads)
    weight = torch.randn(args.out, args.in_features)
    packed_backend = pick_backend("cpu", torch.float32)
    packed = dataclasses.replace(pack(weight, packed_backend), min_packed_rows=1)
    backends = {"plain": pack(weight, "dense"), "packed": packed}
    rows = batch_sizes(args.rows)
    print(f"weight {args.out}x{args.in_features} fp32 ({weight.numel() * 4 / 2**20:.2f} MiB), "
          f"{args.threads} threads, packed backend = {packed_backend}")
    ms = {name: {} for name in backends}
    for m in rows:
        x = torch.randn(m, args.in_features)
        for name, w in backends.items():  # interleaved per row count: a busy machine slows both alike
            ms[name][m] = median_ms(lambda: linear(x, w), args.repeats)
    print("| rows | plain ms | packed ms | plain / first | packed / first | packed / plain |")
    print("|---|---|---|---|---|---|")
    for m in rows:
        p, q = ms["plain"][m], ms["packed"][m]
        print(f"| {m} | {p:.2f} | {q:.2f} | {p / ms['plain'][rows[0]]:.2f} | {q / ms['packed'][rows[0]]:.2f} | "
              f"{q / p:.2f} |")


# ------------------------------------------------------------------ command line
def add_compare_arguments(p):
    p.add_argument("--hf-checkpoint", default=None, help="default: a random-weight tiny MiMo")
    p.add_argument("--task-variant", default=None, choices=list(prompt_tasks()),
                   help="the prompts' task (default: the tiny addition task's; chat tasks through the chat template)")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)


def add_vllm_arguments(p):
    add_compare_arguments(p)
    p.add_argument("--arms", default=",".join(VLLM_ARMS), help=f"comma-separated subset of {list(VLLM_ARMS)}")


def add_spec_decode_arguments(p):
    p.add_argument("--hf-checkpoint", default="checkpoints/tiny-mimo-mtp")
    p.add_argument("--draft-model", default=None, help="draft_model checkpoint (default: the target itself)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; RL rollouts use 1")
    p.add_argument("--rejection-sample-method", default="probabilistic", choices=["strict", "probabilistic"])
    p.add_argument("--device", default="cpu", help="torch device of the engines (cpu, or cuda: steps as CUDA graphs)")
    p.add_argument("--methods", default=None, help="comma-separated subset of the method names")
    p.add_argument("--dflash-drafts", default=None,
                   help="comma-separated DFlash draft directories of the checkpoint: methods 'dflash k=K', "
                        "'dflash k=K adaptive' and 'dflash k=K idle' (drafting nothing) each (K = the draft's block "
                        "size - 1)")
    p.add_argument("--dspark-drafts", default=None,
                   help="comma-separated DSpark draft directories of the checkpoint: methods 'dspark k=K', "
                        "'dspark k=K adaptive', 'dspark k=K sized' (enable_adaptive_verification) and 'dspark k=K "
                        "idle' (drafting nothing) each (K = the draft's block size)")
    p.add_argument("--costs", action="store_true",
                   help="after each batch size's timing, the profile behind it: a plain step, a prompt's prefill, "
                        "and per drafting method a verify of k + 1 tokens and a drafting of k against the step")
    p.add_argument("--eagle3-draft", default=None,
                   help="an EAGLE-3 draft directory of the checkpoint: methods %s and 'eagle3 adaptive' "
                        "(--spec-adaptive, k up to %d)" % (", ".join(f"'eagle3 k={k}'" for k in EAGLE3_KS), max(EAGLE3_KS)))
    p.add_argument("--clock", default="wall", choices=list(CLOCKS),
                   help="time by the wall clock, or by this process's CPU seconds (one thread: what a quiet "
                        "machine's wall clock shows, whatever else the machine runs)")
    p.add_argument("--min-seconds", type=float, default=0.0,
                   help="repeat (beyond --repeats, up to %d) until every method has been timed this long in all "
                        "at each batch size: short runs (many rows) need more repeats for a steady best" % MAX_REPEATS)
    p.add_argument("--stop-at-eos", action="store_true",
                   help="end a response at EOS (a rollout's drain: rows leave as they finish) instead of "
                        "--max-new-tokens for every row; at T = 1 give --rejection-sample-method strict so "
                        "every method samples the same responses")
    p.add_argument("--min-response-len", type=int, default=0,
                   help="with --stop-at-eos: only prompts whose plain response is at least this long (the rows "
                        "left at a rollout's drained end)")
    p.add_argument("--versus", default=None,
                   help="comma-separated FIRST/SECOND pairs of --methods: each batch size also prints FIRST's paired "
                        "speedup over SECOND and a sign test of which was faster, repeat by repeat")
    p.add_argument("--task-variant", default=DEFAULT_TASK_VARIANT, choices=list(prompt_tasks()),
                   help="the prompts' task (longtail: the long-tail model's; chat tasks through the chat template)")
    p.add_argument("--slices", type=int, default=1,
                   help="time each repeat in this many generates of consecutive prompts, the methods interleaved "
                        "at every slice (at 1 row, --slices = --num-prompts puts the methods' runs of each prompt "
                        "next to each other): for comparisons closer than the machine's drift between whole runs")


def add_spec_scale_arguments(p):
    p.add_argument("--batch-sizes", default="1,2,4,8,16")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--online-rates", default=ONLINE_RATES, help="synthetic acceptance per position of the online draft")
    p.add_argument("--frozen-rates", default=FROZEN_RATES, help="... of the frozen draft")
    add_shape_arguments(p)


def add_shape_arguments(p):
    p.add_argument("--device", default="cpu", help="torch device of the engine (cpu or cuda)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    p.add_argument("--hidden", type=int, default=SHAPE["hidden_size"])
    p.add_argument("--intermediate", type=int, default=SHAPE["intermediate_size"])


def add_step_limit_arguments(p):
    add_shape_arguments(p)
    p.add_argument("--hf-checkpoint", default=None, help="time this checkpoint (default: a random model of the shape)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="steps timed back to back per repeat")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens of the engine's own decoding run")
    p.add_argument("--copy-mib", type=int, default=1024, help="MiB the bandwidth probes copy and sum")
    p.add_argument("--compile", action="store_true", help="also the torch.compile + graphed arm (CUDA)")


def add_compaction_arguments(p):
    p.add_argument("--hf-checkpoint", default="checkpoints/tiny-mimo-longtail")
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)


def add_repeatability_arguments(p):
    p.add_argument("--hf-checkpoint", default="checkpoints/tiny-qwen2")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--clock", default="cpu", choices=list(CLOCKS))


def add_gemm_rows_arguments(p):
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", type=int, default=8192, help="the weight's output features (8192 x 4096 fp32: 128 MiB)")
    p.add_argument("--in", dest="in_features", type=int, default=4096)
    p.add_argument("--rows", default="1,2,4,16")


MODES = {"vs-hf": (vs_hf, add_compare_arguments), "vs-vllm": (vs_vllm, add_vllm_arguments),
         "spec-decode": (spec_decode, add_spec_decode_arguments), "spec-scale": (spec_scale, add_spec_scale_arguments),
         "step-limit": (step_limit, add_step_limit_arguments), "compaction": (compaction, add_compaction_arguments),
         "repeatability": (repeatability, add_repeatability_arguments),
         "gemm-rows": (gemm_rows, add_gemm_rows_arguments)}


@exit_on_user_error
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    for name, (run, add_arguments) in MODES.items():
        s = sub.add_parser(name, description=run.__doc__)
        add_arguments(s)
        s.add_argument("--threads", type=int, default=1,
                       help="torch threads (1: fastest for a tiny model and least noisy on a shared machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    MODES[args.mode][0](args)


if __name__ == "__main__":
    main()
