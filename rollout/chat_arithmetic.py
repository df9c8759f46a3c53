"""Chat arithmetic: the verifiable task of the real-model recipe.

One-digit addition, subtraction and multiplication asked as chat messages ("What is 7 * 5?"), the label the
exact result, scored by `--rm-type math` (the response's last `\\boxed{}`, else its last number). Sampled at
T = 1, a chat model of SmolLM2-135M-Instruct's size is often wrong on these, so RL has room to sharpen it (its
starting reward is in BENCHMARKS.md). Subtraction keeps the larger operand first: every label is a whole number
from 0 to 81.

`CHAT_TASKS` is the registry `--task-variant` reads beside the tiny task's variants (rollout/task.py); a chat
task's rows hold chat messages under "messages", which the run renders with the tokenizer's chat template
(`--apply-chat-template --input-key messages`).
"""
import dataclasses
import random
from typing import Callable, Dict, Tuple

OPERATIONS: Dict[str, Callable[[int, int], int]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b,
                                                    "*": lambda a, b: a * b}
DIGITS = range(1, 10)
INPUT_KEY = "messages"  # where a chat task's rows hold their prompt


def one_digit_problem(rng):
    """(a, operator, b) of one-digit operands; for subtraction a >= b (no negative results)."""
    op = rng.choice(sorted(OPERATIONS))
    a, b = rng.choice(DIGITS), rng.choice(DIGITS)
    if op == "-" and a < b:
        a, b = b, a
    return a, op, b


def question(a, op, b):
    return f"What is {a} {op} {b}?"


@dataclasses.dataclass(frozen=True)
class ChatTask:
    """A chat task: how one problem is drawn; its question, label and rows follow from it."""

    draw_problem: Callable[[random.Random], Tuple[int, str, int]]
    input_key: str = INPUT_KEY

    def row(self, problem):
        """{"messages": [{"role": "user", "content": "What is 7 * 5?"}], "label": "35"}."""
        a, op, b = problem
        return {self.input_key: [{"role": "user", "content": question(a, op, b)}], "label": str(OPERATIONS[op](a, b))}

    def prompts(self, n, seed):
        """n rows of seeded problems (the same seed, the same rows)."""
        rng = random.Random(seed)
        return [self.row(self.draw_problem(rng)) for _ in range(n)]


CHAT_TASKS = {"chat_arithmetic": ChatTask(one_digit_problem)}
