"""The real-model recipe's task (rollout/chat_arithmetic.py) and its reward: every generated row's label is the
result Python's `operator` module computes from the question's own text, and `--rm-type math` scores responses
the way a direct check of their last number does (right answers 1, wrong ones 0, whatever the form). A chat task
named without the chat flags is refused in one line before anything starts."""
import operator
import re

import pytest

from rollout.chat_arithmetic import CHAT_TASKS
from rollout.task import prompt_tasks

QUESTION = re.compile(r"^What is (\d) ([-+*]) (\d)\?$")
OPERATOR = {"+": operator.add, "-": operator.sub, "*": operator.mul}  # the reference, apart from the module's table
TASK = CHAT_TASKS["chat_arithmetic"]


def parsed(row):
    """(a, op, b) read back from a row's user message."""
    (message,) = row["messages"]
    assert message["role"] == "user"
    match = QUESTION.match(message["content"])
    assert match, message["content"]
    return int(match[1]), match[2], int(match[3])


def test_every_label_is_the_result_of_the_question_as_written():
    rows = TASK.prompts(500, seed=3)
    assert rows == TASK.prompts(500, seed=3) and rows != TASK.prompts(500, seed=4)
    seen = set()
    for row in rows:
        a, op, b = parsed(row)
        assert 1 <= a <= 9 and 1 <= b <= 9
        assert row["label"] == str(OPERATOR[op](a, b)) and int(row["label"]) >= 0
        seen.add(op)
    assert seen == set(OPERATOR)  # all three operations are drawn
    assert "chat_arithmetic" in prompt_tasks()  # --task-variant finds it


def last_integer(text):
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


@pytest.mark.parametrize("form", ["{q} {a} {op} {b} = {x}.", "The answer is \\boxed{{{x}}}.",
                                  "{a} {op} {b} is {x}, since we {op} the two digits.",
                                  "Let me think. {a} {op} {b} = {x}"])
def test_the_math_reward_scores_a_response_as_a_direct_check_of_its_answer(form):
    pytest.importorskip("math_verify")
    from rollout.rewards import get_reward_fn

    reward = get_reward_fn("math")
    for row in TASK.prompts(24, seed=5):
        a, op, b = parsed(row)
        truth = OPERATOR[op](a, b)
        for x in (truth, truth + 1, truth + 10):
            text = form.format(q=row["messages"][0]["content"], a=a, op=op, b=b, x=x)
            expected = 1.0 if last_integer(text.replace("\\boxed", "")) == truth else 0.0
            assert reward(text, row["label"]) == expected, (text, row["label"])


def test_a_chat_task_without_the_chat_flags_is_refused_in_one_line():
    from orchestration.preflight import check_config
    from vime.cli_config import load_config
    from vime.errors import UserError

    chat = ["--task-variant", "chat_arithmetic", "--apply-chat-template", "--input-key", "messages"]
    check_config(load_config(chat))  # the negative control
    for argv, missing in ((chat[:2], "--apply-chat-template"), (chat[:3], "--input-key messages")):
        with pytest.raises(UserError) as err:
            check_config(load_config(argv))
        assert "\n" not in str(err.value) and "--task-variant chat_arithmetic" in str(err.value)
        assert missing in str(err.value)
