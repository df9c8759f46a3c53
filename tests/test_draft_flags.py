"""The draft's knobs on the command line: each shared knob exists once, a replaced flag (or Hydra key)
is refused in one line naming its replacement (train_rl.py: exit 2), and the kind-dependent rules
read the kind's own defaults."""
import os
import subprocess
import sys

import pytest

from trainer.config import TrainerConfig
from trainer.drafts import check_draft_config
from vime.cli_config import REMOVED_FLAGS, REMOVED_KEYS, help_text, load_config
from vime.config import flag_table
from vime.errors import UserError
from vime.models.draft_kinds import DRAFT_KINDS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = ("--draft-lr", "--draft-steps-per-rollout", "--draft-replay-batches", "--draft-loss-type",
          "--draft-distill-topk", "--draft-clip-grad")


def one_line_error(argv):
    with pytest.raises(UserError) as err:
        load_config(argv)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("old, new", sorted(REMOVED_FLAGS.items()))
def test_a_replaced_flag_is_refused_in_one_line_naming_its_replacement(old, new):
    assert new in flag_table() and old not in flag_table()
    for argv in ([old, "1"], [f"{old}=1"], ["--enable-mtp-training", "--mtp-num-layers", "1", old, "1"]):
        message = one_line_error(argv)
        assert message.startswith(old) and f"pass {new}" in message, message
    old_key, new_key = next((k, v) for k, v in REMOVED_KEYS.items() if v == flag_table()[new][0])
    message = one_line_error([f"{old_key}=1"])
    assert old_key in message and f"set {new_key}" in message, message


def test_train_rl_refuses_a_replaced_flag_with_exit_2():
    proc = subprocess.run([sys.executable, "train_rl.py", "--mtp-lr", "1e-3"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--mtp-lr" in lines[0] and "--draft-lr" in lines[0], proc.stderr


def test_help_lists_each_shared_draft_knob_once_and_no_replaced_flag():
    text = help_text()
    options = [word.rstrip(",") for line in text.splitlines() for word in line.split()[:1]]
    for name in SHARED:
        assert options.count(name) == 1, name
    assert not set(REMOVED_FLAGS) & set(options)
    # the kinds' own defaults (their descriptors') are what --help says
    for kind, words in (("mtp", "MTP layers"), ("eagle3", "EAGLE-3"), ("dflash", "DFlash")):
        d = DRAFT_KINDS[kind].knobs
        for knob in (f"{d.lr:g} for {words}", f"{d.steps_per_rollout} for {words}", f"{d.replay_batches} for {words}"):
            assert knob in " ".join(text.split()), knob


def test_replay_without_draft_only_steps_is_refused_against_the_kinds_own_default():
    base = ["--enable-mtp-training", "--mtp-num-layers", "1"]
    with pytest.raises(UserError, match="--draft-replay-batches 2 .* --draft-steps-per-rollout 1"):
        check_draft_config(TrainerConfig.from_tree(load_config(base + ["--draft-replay-batches", "2"])))
    # with draft-only steps, no more batches than they reach: 2 steps reach this batch and 1 earlier one
    with pytest.raises(UserError, match=r"--draft-replay-batches 2: .* at most 1 earlier ones .* "
                                        r"--draft-steps-per-rollout 4 or more"):
        check_draft_config(TrainerConfig.from_tree(load_config(base + ["--draft-replay-batches", "2",
                                                                       "--draft-steps-per-rollout", "3"])))
    # the negative control, the advice as written: 3 draft-only steps reach the 2 replayed batches
    check_draft_config(TrainerConfig.from_tree(load_config(base + ["--draft-replay-batches", "2",
                                                                   "--draft-steps-per-rollout", "4"])))


def test_draft_training_needs_an_external_draft_in_the_speculative_config():
    with pytest.raises(UserError, match="method 'mtp' drafts with the policy's own MTP layers"):
        check_draft_config(TrainerConfig.from_tree(load_config(["--enable-draft-training"])))
    with pytest.raises(UserError, match="trains an external draft .*got no speculation"):
        check_draft_config(TrainerConfig.from_tree(load_config(["--enable-draft-training",
                                                                "--vllm-speculative-config", "none"])))


@pytest.mark.parametrize("flag, value, needle", [
    ("--draft-ttt-steps", "2", "--mtp-train-depths"),
    ("--draft-loss-scaling-factor", "2", "--mtp-loss-scaling-factor"),
])
def test_an_external_drafts_own_knob_is_refused_for_the_mtp_layers_naming_theirs(flag, value, needle):
    from vime.config import validate

    with pytest.raises(UserError) as err:
        validate(load_config(["--enable-mtp-training", "--mtp-num-layers", "1", flag, value]))
    assert str(err.value).startswith(flag) and needle in str(err.value) and "\n" not in str(err.value)
