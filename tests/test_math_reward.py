"""`--rm-type math`: math-verify's verdicts through the process pool against answers whose
equivalence is known by hand (equivalent forms 1, wrong or missing answers 0, never an exception),
unparsable labels counted, and a runaway call cut at the timeout without stalling the batch."""
import time

import pytest

pytest.importorskip("math_verify")

from rollout.math_reward import RewardPool  # noqa: E402
from rollout.rewards import make_scorer  # noqa: E402
from tests.rewards_for_tests import slow_on_hang  # noqa: E402

CASES = [  # (response, label, score): the answer is the last \boxed{}, else the last number
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{1000}", "1,000", 1.0),
    ("7+2=9;3+8=11;2+6+1=9;\\boxed{919}", "919", 1.0),
    ("The answer is 42.", "42", 1.0),
    ("\\boxed{\\sqrt{4}}", "2", 1.0),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{3.0}", "3", 1.0),
    ("\\boxed{1/2}", "0.5", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ("\\boxed{2}", "3", 0.0),
    ("\\boxed{-4}", "4", 0.0),
    ("\\boxed{918}", "919", 0.0),
    ("\\boxed{\\frac{1}{3}}", "0.33", 0.0),
    ("no answer here", "5", 0.0),
    ("", "5", 0.0),
    ("\\boxed{", "5", 0.0),  # a broken answer is a wrong one, not an exception
]


@pytest.fixture(scope="module")
def math_scorer():
    scorer = make_scorer("math", timeout=30.0, num_workers=2)
    assert isinstance(scorer, RewardPool)
    yield scorer
    scorer.close()


def test_math_verify_equivalences_through_the_pool(math_scorer):
    scores, counts = math_scorer.score([(r, label) for r, label, _ in CASES])
    assert scores == [want for _, _, want in CASES], [c[:2] for c, s in zip(CASES, scores) if s != c[2]]
    assert counts == {"reward_timeouts": 0, "reward_unparsable_labels": 0}


def test_unparsable_labels_score_zero_and_are_counted(math_scorer):
    scores, counts = math_scorer.score([("\\boxed{5}", "\\frac{"), ("\\boxed{5}", "5"), ("\\boxed{5}", "")])
    assert scores == [0.0, 1.0, 0.0]
    assert counts["reward_unparsable_labels"] == 2


def test_a_runaway_call_scores_zero_within_the_timeout_and_the_rest_are_scored():
    pool = RewardPool(timeout=3.0, num_workers=2, fn=slow_on_hang)
    try:
        pool.score([("\\boxed{1}", "1")])  # workers started and math-verify imported: time the batch only
        start = time.perf_counter()
        scores, counts = pool.score([("\\boxed{1}", "1"), ("hang", "1"), ("\\boxed{2}", "2"), ("\\boxed{3}", "4")])
        elapsed = time.perf_counter() - start
    finally:
        pool.close()
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert counts["reward_timeouts"] == 1
    # one timeout plus a restarted pool's start, far below the hung call's hour
    assert elapsed < 3.0 + 60.0
