"""Held-out evaluation's metrics against direct references: pass@k against the share of k-subsets
of a prompt's samples that hold a correct one (enumerated), rewards and lengths by hand, and the
schedule (step 0, then every --eval-interval steps)."""
import itertools

import pytest

from rollout.evaluation import eval_metrics, is_eval_step, pass_at_k
from rollout.spec_stats import empty_counters
from vime.sample import Sample


def enumerated_pass_at_k(outcomes, k):
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n, c, k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (4, 2, 3), (4, 4, 4), (8, 3, 4), (5, 1, 5),
                                     (6, 5, 2)])
def test_pass_at_k_equals_the_share_of_k_subsets_with_a_pass(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(enumerated_pass_at_k([1] * c + [0] * (n - c), k), rel=1e-12)


def test_eval_metrics_of_a_batch():
    rewards = {0: [1, 0, 0, 1], 1: [0, 0, 0, 0], 2: [1, 1, 1, 1]}
    samples = [Sample(prompt_ids=[1], index=i, sample_index=j, response_ids=[5] * (i + j + 1), reward=float(r))
               for i, rs in rewards.items() for j, r in enumerate(rs)]
    m = eval_metrics(samples, 4, empty_counters())
    assert m["eval/reward"] == pytest.approx(6 / 12)
    assert m["eval/pass@4"] == pytest.approx((1 + 0 + 1) / 3)
    lengths = [i + j + 1 for i in range(3) for j in range(4)]
    assert m["eval/response_len"] == pytest.approx(sum(lengths) / 12)


def test_evaluation_runs_at_step_zero_and_every_interval():
    assert [s for s in range(12) if is_eval_step(s, 5)] == [0, 5, 10]
    assert [s for s in range(3) if is_eval_step(s, 1)] == [0, 1, 2]
