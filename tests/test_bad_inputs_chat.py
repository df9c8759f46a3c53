"""Bad chat inputs to train_rl.py, found before any actor starts: one-line UserError naming the flag
or file (the subprocess exit-2 path is the one test_train_rl.py proves for every UserError)."""
import json
import os

import pytest

from train_rl import prepare
from rollout.task import TASK_VARIANTS, chat_prompt_rows, write_jsonl
from rollout.tiny_model import make_random_chat_checkpoint, make_random_checkpoint
from tests.bad_input_helpers import refused
from tests.conftest import SMALL
from vime.cli_config import load_config


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bad_chat_ckpt"))
    make_random_chat_checkpoint(path, seed=5, std=0.3, **SMALL)
    write_jsonl(chat_prompt_rows(TASK_VARIANTS["add"].draw_problem, 8, seed=1), os.path.join(path, "train.jsonl"))
    return path


def chat_args(ckpt, out, *extra):
    return ["--hf-checkpoint", ckpt, "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--global-batch-size", "16", "--micro-batch-size", "8", "--output-dir", str(out),
            "--apply-chat-template", "--input-key", "messages", *map(str, extra)]


def test_the_chat_fixture_passes_preflight(chat_ckpt, tmp_path):
    prepare(load_config(chat_args(chat_ckpt, tmp_path)))  # the negative control of every case below


def test_apply_chat_template_on_a_tokenizer_without_one_is_refused(tmp_path):
    plain = str(tmp_path / "plain")
    make_random_checkpoint(plain, seed=1, **SMALL)
    rows = tmp_path / "chat.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "1+2="}], "label": "3"}) + "\n")
    refused(chat_args(plain, tmp_path / "out", "--prompt-data", rows), "--apply-chat-template", "no chat template")


@pytest.mark.parametrize("messages, needles", [
    ("1+2=", ["line 1", "list of"]),
    ([], ["line 1", "list of"]),
    (["1+2="], ["message 0", "'role'"]),
    ([{"role": "user"}], ["message 0", "'content'"]),
    ([{"role": "user", "content": 3}], ["message 0", "string 'content'"]),
    ([{"role": "robot", "content": "1+2="}], ["unknown role 'robot'", "user"]),
])
def test_bad_messages_rows_are_refused(chat_ckpt, tmp_path, messages, needles):
    rows = tmp_path / "chat.jsonl"
    rows.write_text(json.dumps({"messages": messages, "label": "3"}) + "\n")
    refused(chat_args(chat_ckpt, tmp_path / "out", "--prompt-data", rows), "--prompt-data", *needles)


def test_eval_prompt_data_missing_or_empty_is_refused(chat_ckpt, tmp_path):
    refused(chat_args(chat_ckpt, tmp_path / "out", "--eval-prompt-data", tmp_path / "nope.jsonl"),
            "--eval-prompt-data", "no such file")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    refused(chat_args(chat_ckpt, tmp_path / "out", "--eval-prompt-data", empty), "--eval-prompt-data", "no prompts")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "1+2="}], "label": "3"}) + "\n")
    refused(chat_args(chat_ckpt, tmp_path / "out", "--eval-prompt-data", bad), "--eval-prompt-data", "unknown role")
