"""The speculation-ceiling model's arithmetic (rollout/embedded/spec_ceiling.py) against direct
formulas, and the benchmark's refusals of bad input (scripts/bench/spec_ceiling.py, run as a user runs it)."""
import pathlib
import subprocess
import sys

import pytest

from rollout.embedded import spec_ceiling
from rollout.embedded.spec_policy import StepRecord, expected_tokens

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_conditional_acceptance_is_the_share_accepted_among_rows_that_reached_the_position():
    # 10 rows drafting 3 tokens each, accepting 0, 1, 2 or 3 of them, seen as engine steps in two bands
    accepted_counts = [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
    reached = [sum(n >= i for n in accepted_counts) for i in range(3)]  # rows with positions < i accepted
    accepted = [sum(n > i for n in accepted_counts) for i in range(3)]
    timed = spec_ceiling.StepTimes(3)
    for part in (accepted_counts[:4], accepted_counts[4:]):  # 4 rows, then 6: bands 3-4 and 5-8
        timed.observe(StepRecord(len(part), 3, 0.01, 3, 0.01, len(part),
                                 [sum(n >= i for n in part) for i in range(3)], [sum(n > i for n in part) for i in range(3)]))
    expected = [accepted[i] / reached[i] for i in range(3)]
    assert spec_ceiling.conditional_acceptance(timed.bands) == pytest.approx(expected)


def test_cost_curve_takes_the_median_at_a_batch_size_and_interpolates_between():
    curve = spec_ceiling.cost_curve([(2, 1.0), (2, 9.0), (2, 2.0), (6, 4.0)])
    assert curve(2) == 2.0 and curve(6) == 4.0
    assert curve(4) == pytest.approx(3.0)
    assert curve(1) == 2.0 and curve(8) == 4.0  # held flat outside the batch sizes seen


def test_oracle_never_drafts_when_nothing_is_accepted_and_gains_one_plus_k_when_drafting_is_free():
    plain = [(b, 0.001 * b) for b in (1, 1, 4, 16, 16, 64)]
    plain_curve = spec_ceiling.cost_curve(plain)
    plain_seconds = sum(plain_curve(b) for b, _ in plain)
    costly = {0: plain_curve, 1: lambda b: 1.5 * plain_curve(b), 2: lambda b: 2.0 * plain_curve(b)}
    seconds, chosen = spec_ceiling.oracle_time(plain, costly, lambda b: [0.0, 0.0])
    assert chosen == [0] * len(plain) and seconds == pytest.approx(plain_seconds)
    free = {k: plain_curve for k in range(3)}
    seconds, chosen = spec_ceiling.oracle_time(plain, free, lambda b: [1.0, 1.0])
    assert chosen == [2] * len(plain) and seconds == pytest.approx(plain_seconds / expected_tokens([1.0, 1.0], 2))


@pytest.mark.parametrize("argv, flag", [
    (["--acceptance", "x=0.5,1.5,0.2"], "--acceptance"),
    (["--acceptance", "0.5,0.5,0.5"], "--acceptance"),
    (["--acceptance", "x=0.5"], "--acceptance"),
    (["--num-speculative-tokens", "0"], "--num-speculative-tokens"),
    (["--batches", "0"], "--batches"),
    (["--threads", "0"], "--threads"),
    (["--hf-checkpoint", "/no/such/checkpoint"], "--hf-checkpoint"),
])
def test_spec_ceiling_refuses_bad_input_with_one_line(argv, flag):
    proc = subprocess.run([sys.executable, "scripts/bench/spec_ceiling.py", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith(f"error: {flag}"), err


def test_acceptance_by_band_reads_the_rows_at_that_batch_size_and_falls_back_to_the_overall_rate():
    timed = spec_ceiling.StepTimes(2)
    record = StepRecord
    timed.observe(record(3, 2, 0.01, 2, 0.01, 3, [3, 2], [2, 1]))  # band 3-4 rows: 2 of 3, then 1 of 2
    timed.observe(record(4, 2, 0.01, 2, 0.01, 4, [4, 0], [1, 0]))  # position 2 never reached here
    timed.observe(record(100, 1, 0.05, 1, 0.01, 100, [100], [90]))  # band 65-128 rows
    overall = [0.6, 0.4]
    at = spec_ceiling.acceptance_by_band(timed.bands, overall)
    assert at(3) == at(4) == pytest.approx([3 / 7, 1 / 2])
    assert at(128) == pytest.approx([0.9, 0.4])  # position 2 unseen in that band
    assert at(1) == overall and at(16) == overall  # bands never measured
