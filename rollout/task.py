"""The tiny verifiable task vime trains on: 3-digit addition, answered after a '#'.

Two answer formats exist. `direct` ("#632") is what most of the pretraining corpus uses
and is hard for a tiny model; `trace` ("7+5=12;4+8+1=13;3+2+1=6;#632") works the sum
digit by digit, is rare in pretraining, and is right far more often. The reward only
checks the answer, so RL moves the policy from direct to trace: its output distribution
shifts to text the frozen MTP draft was never trained on (the drift benchmark's premise).

Prompt sets come in variants (`TASK_VARIANTS`, chosen with rollout.task_variant): `add`,
the default above (two 3-digit operands), and `longtail`: 2-5 operands of 1-6 digits drawn
so most problems are short and a few are long, as in RL where a batch drains from full to a
few long stragglers. Its trace answers (one column sum per digit, `multi_trace_answer`)
range from about 10 to 100 tokens; the reward is the same (the sum after '#').
"""
import dataclasses
import json
import random
from typing import Callable, List

SPECIALS = ("<pad>", "<bos>", "<eos>")
CHARS = "0123456789+=;#"
PAD, BOS, EOS = 0, 1, 2


def make_problem(rng, digits=3):
    lo, hi = 10 ** (digits - 1), 10 ** digits - 1
    return rng.randint(lo, hi), rng.randint(lo, hi)


def direct_answer(a, b):
    return ANSWER_FORMATS["direct"]([a, b])


def trace_answer(a, b):
    """Digit-by-digit sum, least significant first, carries included (`multi_trace_answer` of two)."""
    return multi_trace_answer([a, b])


def extract_answer(response_text):
    """The text after the last '#', or None when there is none."""
    if "#" not in response_text:
        return None
    return response_text.rsplit("#", 1)[1].strip()


def tiny_add_reward(response_text, label):
    """1.0 when the answer after the last '#' equals the label exactly, else 0.0."""
    return 1.0 if extract_answer(response_text) == str(label).strip() else 0.0


def two_operand_problem(rng, digits=3):
    """The default task's operands: two numbers of `digits` digits."""
    return list(make_problem(rng, digits))


def make_prompts(n, seed, digits=3):
    """[{"prompt": "347+285=", "label": "632"}, ...]: the RL prompt set."""
    return prompt_rows(lambda rng: two_operand_problem(rng, digits), n, seed)


# ------------------------------------------------------------------ the long-tail variant
LONGTAIL_OPERANDS = (2, 5)
LONGTAIL_DIGITS = (1, 6)
LONGTAIL_DECAY = 0.55  # P(size s+1) / P(size s): short problems dominate, long ones stay common enough


def long_tailed_int(rng, lo, hi, decay=LONGTAIL_DECAY):
    """lo..hi with P(v) proportional to decay**(v - lo)."""
    weights = [decay ** (v - lo) for v in range(lo, hi + 1)]
    return rng.choices(range(lo, hi + 1), weights)[0]


def make_multi_problem(rng):
    """2-5 operands of one long-tailed digit count (1-6) each."""
    count = long_tailed_int(rng, *LONGTAIL_OPERANDS)
    digits = long_tailed_int(rng, *LONGTAIL_DIGITS)
    return [make_problem(rng, digits)[0] for _ in range(count)]


def multi_prompt_text(operands):
    return "+".join(map(str, operands)) + "="


def multi_trace_answer(operands):
    """Column sums, least significant first, carry last: '7+5+1+2=15;...;#<sum>'."""
    columns = max(len(str(x)) for x in operands)
    steps, carry = [], 0
    for i in range(columns):
        digits = [int(str(x)[::-1][i]) if i < len(str(x)) else 0 for x in operands]
        total = sum(digits) + carry
        steps.append("+".join(map(str, digits + ([carry] if carry else []))) + f"={total}")
        carry = total // 10
    return ";".join(steps) + f";#{sum(operands)}"


def prompt_rows(draw_problem, n, seed):
    """n rows {"prompt": "12+345+6=", "label": "363"} of problems from `draw_problem(rng)`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        operands = draw_problem(rng)
        rows.append({"prompt": multi_prompt_text(operands), "label": str(sum(operands))})
    return rows


# Corpus answer formats over an operand list (two operands: `direct_answer` / `trace_answer`).
ANSWER_FORMATS = {"direct": lambda operands: f"#{sum(operands)}", "trace": multi_trace_answer}


@dataclasses.dataclass(frozen=True)
class TaskVariant:
    """A tiny-task variant: how one problem is drawn (pretraining corpus and RL prompts alike).

    `draw_problem(rng)` returns the operands; prompt, label and answer formats follow from them."""

    draw_problem: Callable[[random.Random], List[int]]

    def prompts(self, n, seed):
        return prompt_rows(self.draw_problem, n, seed)


TASK_VARIANTS = {
    "add": TaskVariant(two_operand_problem),
    "longtail": TaskVariant(make_multi_problem),
}
DEFAULT_TASK_VARIANT = "add"


def prompt_tasks():
    """{name: task} of every prompt set --task-variant makes: the tiny task's variants and the chat tasks
    (rollout/chat_arithmetic.py), each with `prompts(n, seed)`."""
    from rollout.chat_arithmetic import CHAT_TASKS

    return {**TASK_VARIANTS, **CHAT_TASKS}


def check_task_variant(r):
    """--task-variant names a prompt task (None: prompts from --prompt-data); a chat task's rows hold chat
    messages under its input key, which the run reads only with --apply-chat-template and that --input-key.
    `r`: the rollout section."""
    from rollout.chat_arithmetic import CHAT_TASKS
    from vime.errors import require

    variant = r.task_variant
    require(variant is None or variant in prompt_tasks(),
            f"--task-variant {variant!r}: choose one of {', '.join(sorted(prompt_tasks()))}")
    chat = CHAT_TASKS.get(variant)
    require(chat is None or (r.apply_chat_template and r.input_key == chat.input_key),
            f"--task-variant {variant} makes chat messages under {chat and chat.input_key!r}: give "
            f"--apply-chat-template --input-key {chat and chat.input_key}")


def write_jsonl(rows, path):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------ the chat format
# The chat model's rows: the prompt as chat messages, the answer ending in \boxed{<sum>} (as math
# RL data and verifiers expect) instead of '#<sum>'.
def chat_messages(operands):
    return [{"role": "user", "content": multi_prompt_text(operands)}]


def boxed_answer(answer):
    """An `ANSWER_FORMATS` answer ('...;#632') with its final '#<sum>' as '\\boxed{<sum>}'."""
    head, _, total = answer.rpartition("#")
    return head + "\\boxed{" + total + "}"


def chat_prompt_rows(draw_problem, n, seed):
    """n rows {"messages": [{"role": "user", "content": "12+345="}], "label": "357"}."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        operands = draw_problem(rng)
        rows.append({"messages": chat_messages(operands), "label": str(sum(operands))})
    return rows
