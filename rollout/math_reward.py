"""`--rm-type math`: the response's final answer (its last `\\boxed{}`, else its last number) checked
against the label with Hugging Face's `math-verify`, in a process pool with a bounded time per call.

Equivalent forms score 1 (`\\frac{1}{2}` and `0.5`, `1,000` and `1000`), anything else 0, never an
exception. Verification is symbolic (sympy) and can take unbounded time on adversarial text, so it
runs in worker processes: a call past `--reward-timeout` seconds scores 0, its worker is killed and
the pool restarted, and the step counts it (`rollout/reward_timeouts`). A label math-verify cannot
parse scores 0 and is counted too (`rollout/reward_unparsable_labels`): bad data, not a crash.
"""
import multiprocessing
import threading

# What a scoring call reports besides the score.
OK, UNPARSABLE_LABEL = "ok", "unparsable_label"


def parse_label(label):
    """math-verify's parse of a reference answer, or None when it yields no expression."""
    from math_verify import parse

    text = str(label).strip()
    parsed = parse(text if text.startswith("$") or "\\boxed" in text else f"${text}$")
    return parsed if any(not isinstance(p, str) for p in parsed) else None


def math_verify_score(response, label):
    """(score, status): 1.0 when the response's final answer equals the label mathematically."""
    from math_verify import parse, verify

    gold = parse_label(label)
    if gold is None:
        return 0.0, UNPARSABLE_LABEL
    answer = parse(response or "")
    return (1.0 if answer and verify(gold, answer) else 0.0), OK


STARTUP_TIMEOUT = 300.0  # seconds workers may take to start and import the verifier (not a call's time)


def _init_worker(fn, barrier):
    """Import the verifier (math-verify, sympy: seconds) before any call's clock starts."""
    fn("1", "1")
    try:
        barrier.wait(STARTUP_TIMEOUT)
    except threading.BrokenBarrierError:  # a worker the pool replaced later has no one to wait for
        pass


def _score_safely(fn, response, label):
    """`fn` in a worker: an exception of the verifier is a 0, never a crash of the rollout."""
    try:
        return fn(response, label)
    except Exception:  # math-verify/sympy failures on odd text are a wrong answer, not an error
        return 0.0, OK


class RewardPool:
    """Scores (response, label) pairs in worker processes, each call bounded by `timeout` seconds.

    `fn(response, label) -> (score, status)` must be importable by name (the workers are spawned:
    forking a Ray actor's threads is unsafe)."""

    def __init__(self, timeout, num_workers=2, fn=math_verify_score):
        self.timeout, self.num_workers, self.fn = timeout, num_workers, fn
        self._pool = None

    def _ensure_pool(self):
        """The pool, started and warm: every worker has imported the verifier, so a call's timeout
        bounds the verification, not the workers' start."""
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")
            barrier = ctx.Barrier(self.num_workers + 1)
            self._pool = ctx.Pool(self.num_workers, initializer=_init_worker, initargs=(self.fn, barrier))
            barrier.wait(STARTUP_TIMEOUT)
        return self._pool

    def _restart(self):
        """Kill the workers (one is stuck in a call) and start afresh on the next score."""
        self._pool.terminate()
        self._pool.join()
        self._pool = None

    def score(self, pairs):
        """([score per pair], {"reward_timeouts": n, "reward_unparsable_labels": n})."""
        pending = [self._ensure_pool().apply_async(_score_safely, (self.fn, r, l)) for r, l in pairs]
        scores, counts = [], {"reward_timeouts": 0, "reward_unparsable_labels": 0}
        for i, job in enumerate(pending):
            try:
                score, status = job.get(self.timeout)
            except multiprocessing.TimeoutError:
                # the stuck worker is killed with the pool; the calls queued behind it are redone
                counts["reward_timeouts"] += 1
                scores.append(0.0)
                self._restart()
                rest, rest_counts = self.score(pairs[i + 1:])
                return scores + rest, {k: counts[k] + rest_counts[k] for k in counts}
            counts["reward_unparsable_labels"] += status == UNPARSABLE_LABEL
            scores.append(float(score))
        return scores, counts

    def close(self):
        if self._pool is not None:
            self._restart()
