"""The throughput bench's timing harness (scripts/bench/throughput.py): what is on the clock, how many
repeats --min-seconds adds, and the repeatability mode's refusals. The clock is the wall clock and
the runs sleep, so every bound below is a sleep's length, far from the scheduler's jitter."""
import time

import pytest
import torch

from scripts.bench.throughput import MAX_REPEATS, head_to_head, main, paired_median, time_interleaved
from vime.sample import Sample

RUN_S, PREPARE_S = 0.01, 0.2


class SleepingRun:
    """A run of one 4-token sample taking RUN_S, its `prepare` PREPARE_S; counts its calls."""

    def __init__(self):
        self.calls = self.prepared = 0

    def prepare(self):
        self.prepared += 1
        time.sleep(PREPARE_S)

    def __call__(self):
        self.calls += 1
        time.sleep(RUN_S)
        return [Sample(prompt_ids=[1], response_ids=[5, 6, 7, 8])]


def test_a_runs_prepare_is_off_the_clock():
    run = SleepingRun()
    (rate, samples), = time_interleaved({"a": run}, repeats=2).values()
    assert run.prepared == run.calls == 2
    assert 4 / rate < PREPARE_S  # the best run's seconds: its sleep, not its preparation's
    assert [s.response_ids for s in samples] == [[5, 6, 7, 8]]


def test_min_seconds_repeats_until_every_run_was_timed_that_long_and_no_further_than_max_repeats():
    runs = {"a": SleepingRun(), "b": SleepingRun()}
    time_interleaved(runs, repeats=2, min_seconds=5 * RUN_S)
    # each call takes at least RUN_S: at most 5 calls reach 5 RUN_S (and at least 2, the repeats)
    assert all(2 <= r.calls <= 5 for r in runs.values()) and runs["a"].calls == runs["b"].calls
    calls = []
    time_interleaved({"c": lambda: calls.append(1) or [Sample(prompt_ids=[1], response_ids=[5])]}, repeats=1,
                     min_seconds=1e9)
    assert len(calls) == MAX_REPEATS


@pytest.mark.parametrize("flag", ["--repeats", "--batch-size", "--num-prompts", "--max-new-tokens"])
def test_the_repeatability_mode_refuses_a_count_below_one_in_one_line(flag, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["repeatability", flag, "0"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and flag in err


def test_the_runs_order_rotates_at_each_repeat():
    """Every run takes every place in the order: repeat r starts at run r mod n."""
    order = []

    def run(name):
        return lambda: order.append(name) or [Sample(prompt_ids=[1], response_ids=[5])]
    time_interleaved({n: run(n) for n in "abc"}, repeats=3)
    assert order == list("abc") + list("bca") + list("cab")


class SlicedRun:
    """A run in `n` slices, each a sample of `tokens` tokens that logs (name, slice) and sleeps `seconds`."""

    def __init__(self, name, n, tokens, seconds, log):
        def part(j):
            return lambda: log.append((name, j)) or time.sleep(seconds) or [Sample(prompt_ids=[1],
                                                                                   response_ids=[5] * tokens)]
        self.slices = [part(j) for j in range(n)]

    def __call__(self):
        raise AssertionError("a sliced run is timed slice by slice")


def test_sliced_runs_are_interleaved_at_every_slice_and_rated_over_all_their_slices():
    """Runs in slices take turns slice by slice, the order rotated at each slice and each repeat (repeat r,
    slice j: starting at run (r + j) mod n); a repeat's rate is its slices' tokens over their summed seconds
    (the direct formula, within the sleep's jitter) and its samples are every slice's, in order."""
    log, rates = [], {}
    runs = {"a": SlicedRun("a", 3, 4, RUN_S, log), "b": SlicedRun("b", 3, 2, 2 * RUN_S, log)}
    got = time_interleaved(runs, repeats=2, rates=rates)
    want = []
    for r in range(2):
        for j in range(3):
            names = "ab"[(r + j) % 2:] + "ab"[:(r + j) % 2]
            want += [(n, j) for n in names]
    assert log == want
    assert len(got["a"][1]) == 3 and all(len(s.response_ids) == 4 for s in got["a"][1])
    # each rate is all its slices' tokens over at least all their sleeps (12 tokens in >= 3 RUN_S, 6 in >= 6 RUN_S):
    # one slice's tokens or seconds alone would break the bound 3x
    assert len(rates["a"]) == len(rates["b"]) == 2
    assert all(x <= 12 / (3 * RUN_S) for x in rates["a"]) and all(x <= 6 / (6 * RUN_S) for x in rates["b"])


@pytest.mark.parametrize("slices", ["0", "5"])
def test_spec_decode_refuses_slices_smaller_than_a_batch_in_one_line(slices, capsys):
    """--slices 5 of 8 prompts at 2 rows would leave slices of one prompt: a smaller batch than asked."""
    with pytest.raises(SystemExit) as stop:
        main(["spec-decode", "--hf-checkpoint", "checkpoints/tiny-qwen2", "--methods", "none", "--num-prompts", "8",
              "--batch-sizes", "1,2", "--slices", slices])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "--slices" in err


def test_a_sliced_proposer_run_generates_each_slice_of_consecutive_prompts_as_the_whole_run_does():
    """proposer_run in 3 slices of 7 prompts: generates of 2, 2 and 3 consecutive prompts (their indices kept, so
    each request keeps its random stream), whose greedy responses are the unsliced run's, token for token."""
    from rollout.embedded.engine import EngineConfig
    from rollout.embedded.engine_builder import build_engine
    from rollout.sampling_params import SamplingParams
    from scripts.bench.throughput import proposer_run, variant_prompts

    prompts = variant_prompts("checkpoints/tiny-qwen2", "add", 7)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=False, seed=1)
    engine = build_engine("checkpoints/tiny-qwen2", None, EngineConfig(max_batch_size=2))
    sliced, whole = proposer_run(engine, None, prompts, sampling, slices=3), proposer_run(engine, None, prompts, sampling)
    assert [len(part()) for part in sliced.slices] == [2, 2, 3] and len(whole.slices) == 1
    assert [s.response_ids for s in sliced()] == [s.response_ids for s in whole()]


def test_spec_decode_refuses_negative_min_seconds_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["spec-decode", "--min-seconds", "-1"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "--min-seconds" in err


@pytest.mark.parametrize("device", ["gpu", pytest.param("cuda", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="the refusal is of a machine without CUDA"))])
@pytest.mark.parametrize("mode", ["spec-decode", "spec-scale", "step-limit"])
def test_a_device_this_machine_lacks_is_refused_in_one_line(mode, device, capsys):
    with pytest.raises(SystemExit) as stop:
        main([mode, "--device", device])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and f"--device {device}" in err


def test_time_interleaved_hands_back_every_repeats_rate_in_order():
    rates = {}
    runs = {n: (lambda n=n: [Sample(prompt_ids=[1], response_ids=[5] * (1 + "ab".index(n)))]) for n in "ab"}
    time_interleaved(runs, repeats=3, rates=rates)
    assert sorted(rates) == ["a", "b"] and all(len(r) == 3 and all(x > 0 for x in r) for r in rates.values())


def test_the_paired_speedup_is_the_median_of_each_repeats_ratio_to_the_base():
    """Against the written-out medians: the base's own is 1, and one repeat a burst hit moves the median
    of three no further than the middle ratio."""
    rates = {"none": [10.0, 20.0, 5.0], "x": [15.0, 22.0, 50.0]}
    paired = paired_median(rates, "none")
    assert paired["none"] == 1.0
    assert paired["x"] == sorted([15 / 10, 22 / 20, 50 / 5])[1]


def test_head_to_head_is_the_median_ratio_and_a_two_sided_sign_test():
    """Against written-out values: the median of the per-repeat ratios; the sign test's p-value from the binomial
    tail at 1/2 (5 of 5: 2 / 2^5; 4 of 5: 2 (1 + 5) / 2^5); a repeat a burst hit counts once, whatever its size."""
    first, second = [12.0, 11.0, 30.0, 10.5, 11.5], [10.0, 10.0, 10.0, 10.0, 10.0]
    ratio, wins, n, p = head_to_head({"a": first, "b": second}, "a", "b")
    assert ratio == pytest.approx(1.15) and (wins, n) == (5, 5) and p == pytest.approx(2 / 32)
    first[3] = 9.0
    ratio, wins, n, p = head_to_head({"a": first, "b": second}, "a", "b")
    assert ratio == pytest.approx(1.15) and wins == 4 and p == pytest.approx(2 * 6 / 32)
    assert head_to_head({"a": first, "b": second}, "b", "a")[1:] == (1, 5, pytest.approx(2 * 6 / 32))


def test_spec_decode_refuses_a_versus_pair_outside_its_methods_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["spec-decode", "--hf-checkpoint", "checkpoints/tiny-qwen2", "--methods", "none", "--versus", "none/mtp k=1"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "--versus" in err


def test_a_run_keeps_its_engines_proposer_unless_it_remembers_earlier_outputs():
    """As an engine keeps its proposer across generates, the bench keeps it across repeats (a DSpark draft's
    kept-state buffer is allocated and touched once); suffix decoding, whose drafts follow earlier outputs,
    gets a fresh proposer at each prepare, so no repeat replays the one before."""
    from rollout.embedded.engine import EngineConfig
    from rollout.embedded.engine_builder import build_engine
    from rollout.sampling_params import SamplingParams
    from scripts.bench.throughput import proposer_run

    sampling = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, seed=1)
    specs = {"suffix": {"method": "suffix", "num_speculative_tokens": 2},
             "dspark": {"method": "dspark", "num_speculative_tokens": 3, "model": "checkpoints/tiny-qwen2-dspark"}}
    for method, spec in specs.items():
        engine = build_engine("checkpoints/tiny-qwen2", spec, EngineConfig(max_batch_size=2))
        run = proposer_run(engine, spec, [[1, 5, 9], [1, 7, 3]], sampling)
        run.prepare()
        first = engine.proposer
        run()
        run.prepare()
        if method == "suffix":
            assert engine.proposer is not first and not engine.proposer.responses  # nothing to replay
            assert first.responses  # the run had filled the one it replaced
        else:
            assert engine.proposer is first


def test_spec_decode_refuses_an_eagle3_draft_that_is_not_a_directory_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["spec-decode", "--hf-checkpoint", "checkpoints/tiny-qwen2", "--eagle3-draft", str(tmp_path / "nothing")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "--eagle3-draft" in err


def test_an_adaptive_method_is_compared_with_none_and_its_own_draft_at_fixed_k():
    from scripts.bench.throughput import fixed_k_of

    methods = ["none", "mtp k=1", "mtp k=2", "mtp adaptive", "eagle3 k=1", "eagle3 k=3", "eagle3 adaptive",
               "dflash k=3", "dflash k=3 adaptive", "dflash k=3 idle", "dflash k=7"]
    assert fixed_k_of("mtp adaptive", methods) == ["none", "mtp k=1", "mtp k=2"]
    assert fixed_k_of("eagle3 adaptive", methods) == ["none", "eagle3 k=1", "eagle3 k=3"]
    assert fixed_k_of("dflash k=3 adaptive", methods) == ["none", "dflash k=3"]


def test_spec_decode_times_an_eagle3_draft_at_each_fixed_k_and_adaptive(capsys):
    """The tiny EAGLE-3 draft, greedy: every method makes the plain responses (the bench refuses otherwise), and
    each fixed-k row drafts k positions."""
    main(["spec-decode", "--hf-checkpoint", "checkpoints/tiny-qwen2", "--eagle3-draft", "checkpoints/tiny-qwen2-eagle3",
          "--batch-sizes", "2", "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "1",
          "--methods", "none,eagle3 k=1,eagle3 k=3,eagle3 adaptive"])
    rows = {line.split("|")[2].strip(): line.split("|")[8].strip() for line in capsys.readouterr().out.splitlines()
            if line.startswith("| 2 |")}
    assert set(rows) == {"none", "eagle3 k=1", "eagle3 k=3", "eagle3 adaptive"}
    assert rows["none"] == "-" and rows["eagle3 k=1"].count("/") == 0 and rows["eagle3 k=3"].count("/") == 2


def test_the_decode_rate_is_the_tokens_after_each_first_over_the_seconds_outside_the_prefills():
    """decode_rates against the written-out formula: a run of 2 slices timed twice, each generate's
    (tokens after each response's first, prefill seconds) summed over its repeat's slices."""
    from types import SimpleNamespace

    from scripts.bench.throughput import decode_rates
    run = SimpleNamespace(slices=[None, None], prefills=[(10, 0.5), (20, 1.0), (12, 0.25), (6, 0.75)])
    assert decode_rates(run, [4.0, 3.0]) == [(10 + 20) / (4.0 - 1.5), (12 + 6) / (3.0 - 1.0)]


def test_the_engines_prefill_clock_holds_its_prompt_forwards_and_none_of_its_decode_steps(monkeypatch):
    """Each prompt forward and each decode step made DELAY slower: the generate's `prefill_seconds` holds at
    least a DELAY per prompt forward, and the seconds outside it at least a DELAY per decode step, so neither
    clock lends the other its time (bounds of sleeps, far from the scheduler's jitter)."""
    from rollout.embedded.engine import Engine, EngineConfig
    from rollout.embedded.engine_builder import build_engine
    from rollout.sampling_params import SamplingParams
    from scripts.bench.throughput import indexed_samples, variant_prompts

    delay, counts = 0.05, {"prefill": 0, "step": 0}

    def slowed(name, method):
        def run(self, *a, **kw):
            counts[name] += 1
            time.sleep(delay)
            return method(self, *a, **kw)
        return run
    monkeypatch.setattr(Engine, "_prompt_forward", slowed("prefill", Engine._prompt_forward))
    monkeypatch.setattr(Engine, "_verify_step", slowed("step", Engine._verify_step))
    engine = build_engine("checkpoints/tiny-qwen2", None, EngineConfig(max_batch_size=2))
    engine.generate(indexed_samples(variant_prompts("checkpoints/tiny-qwen2", "add", 3)),
                    SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True, seed=1))
    stats = engine.stats()
    assert counts["prefill"] == 2 and counts["step"] >= 3  # 2 rows: a prefill of 2 prompts, one of the third
    assert stats["prefill_seconds"] >= counts["prefill"] * delay
    assert stats["seconds"] - stats["prefill_seconds"] >= counts["step"] * delay


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_spec_decode_gives_the_decode_phase_on_the_wall_clock_only(clock, capsys):
    """The engine clocks its prefills on the wall clock: under --clock cpu the decode column is left empty, not a
    ratio of two clocks."""
    main(["spec-decode", "--hf-checkpoint", "checkpoints/tiny-qwen2", "--methods", "none", "--num-prompts", "2",
          "--batch-sizes", "2", "--max-new-tokens", "4", "--repeats", "1", "--clock", clock])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 | none |"))
    assert row.split("|")[5].strip() == ("1.00x" if clock == "wall" else "-")
