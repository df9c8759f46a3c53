"""What `--load` resumes from: every file of a checkpoint checked against the manifest written at
save, the newest valid checkpoint taken (one line names those passed over and why), one iteration
taken exactly (`--load ROOT/iter_N`, `--ckpt-step N`), and every refusal's advice, followed as
written, works. The checkpoints are written by `vime.checkpointing.save` itself."""
import errno
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from tests.bad_input_helpers import refused
from tests.test_bad_inputs import args_for, ckpt  # noqa: F401  (ckpt: the bad-input tests' fixture)
from train_rl import prepare
from vime import checkpointing
from vime.cli_config import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MTP = ("--num-rollout", 9, "--enable-mtp-training", "--mtp-num-layers", 1)


def writer(path):
    """The files a trainer save leaves (a torch pickle, the meta JSON, a data file), small."""
    os.makedirs(path)
    torch.save({"step": torch.tensor(3), "layer": torch.arange(64.0)}, os.path.join(path, "common.pt"))
    json.dump({"mtp_num_layers": 1, "mtp_trained": True, "has_optimizer": True},
              open(os.path.join(path, "vime_meta.json"), "w"), indent=2)
    open(os.path.join(path, "__0_0.distcp"), "wb").write(bytes(range(256)) * 4)


def saved(root, steps=(1, 2)):
    for step in steps:
        checkpointing.save(str(root), step, writer, {"step": step, "data_cursor": 4 * step})
    return str(root)


def resumes_from(ckpt, out, root, *extra):
    cfg = load_config(args_for(ckpt, out, "--load", root, *MTP, *extra))
    prepare(cfg)
    return os.path.basename(cfg.run.load)


def truncate(path, keep):
    with open(path, "r+b") as f:
        f.truncate(keep)


def flip_a_byte(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("damage, why", [
    (lambda m: truncate(os.path.join(m, "vime_meta.json"), 20), "model/vime_meta.json has 20 bytes, the manifest says"),
    (lambda m: truncate(os.path.join(m, "common.pt"), 100), "model/common.pt has 100 bytes, the manifest says"),
    (lambda m: flip_a_byte(os.path.join(m, "__0_0.distcp")), "model/__0_0.distcp differs from its checksum"),
])
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_older_one_in_one_line(ckpt, tmp_path, capsys, damage, why):
    root = saved(tmp_path / "save")
    damage(os.path.join(root, "iter_0000002", "model"))
    assert resumes_from(ckpt, tmp_path, root) == "iter_0000001"
    lines = [x for x in capsys.readouterr().out.splitlines() if "passed over" in x]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"[vime] --load {root}: resuming from step 1 (iter_0000001), passed over: "
                               "iter_0000002 (") and why in lines[0], lines[0]


def test_an_intact_checkpoint_is_taken_without_a_word_and_latest_wins_over_a_leftover(ckpt, tmp_path, capsys):
    root = saved(tmp_path / "save", steps=(1, 2, 3))
    assert resumes_from(ckpt, tmp_path, root) == "iter_0000003"
    # a run resumed from step 1 leaves its first try's step 2 and 3 behind until it saves over them
    json.dump({"step": 1}, open(os.path.join(root, checkpointing.LATEST), "w"))
    assert resumes_from(ckpt, tmp_path, root) == "iter_0000001"
    assert "passed over" not in capsys.readouterr().out


def test_a_damaged_or_missing_latest_file_falls_back_to_the_newest_valid_iteration_saying_so(ckpt, tmp_path, capsys):
    root = saved(tmp_path / "save")
    open(os.path.join(root, checkpointing.LATEST), "w").write("{step: 2")
    assert resumes_from(ckpt, tmp_path, root) == "iter_0000002"
    assert "passed over: latest_checkpointed_iteration.txt is damaged" in capsys.readouterr().out
    os.remove(os.path.join(root, checkpointing.LATEST))
    assert resumes_from(ckpt, tmp_path, root) == "iter_0000002"
    assert "passed over: latest_checkpointed_iteration.txt is missing" in capsys.readouterr().out


def test_one_iteration_is_loaded_exactly_and_its_damage_advises_the_root(ckpt, tmp_path):
    root = saved(tmp_path / "save")
    assert resumes_from(ckpt, tmp_path, os.path.join(root, "iter_0000001")) == "iter_0000001"
    assert resumes_from(ckpt, tmp_path, root, "--ckpt-step", 1) == "iter_0000001"
    truncate(os.path.join(root, "iter_0000002", "model", "common.pt"), 10)
    message = refused(args_for(ckpt, tmp_path, "--load", os.path.join(root, "iter_0000002"), *MTP),
                      f"--load {root}/iter_0000002: model/common.pt has 10 bytes")
    advice = re.search(r"; (--load \S+) resumes from the newest valid checkpoint there$", message)
    assert advice, message
    assert resumes_from(ckpt, tmp_path, advice.group(1).split()[1]) == "iter_0000001"  # the advice, as written
    refused(args_for(ckpt, tmp_path, "--load", root, *MTP, "--ckpt-step", 2),
            f"--load {root} --ckpt-step 2: model/common.pt has 10 bytes", f"--load {root} without --ckpt-step")


def test_ckpt_step_names_the_steps_there_and_needs_a_root(ckpt, tmp_path):
    root = saved(tmp_path / "save")
    message = refused(args_for(ckpt, tmp_path, "--load", root, *MTP, "--ckpt-step", 7),
                      f"--ckpt-step 7: --load {root} holds no iter_0000007", "steps 1, 2")
    first = re.search(r"steps (\d+)", message).group(1)
    assert resumes_from(ckpt, tmp_path, root, "--ckpt-step", first) == "iter_0000001"
    refused(args_for(ckpt, tmp_path, "--load", os.path.join(root, "iter_0000001"), *MTP, "--ckpt-step", 1),
            "drop one of them")
    refused(args_for(ckpt, tmp_path, *MTP, "--ckpt-step", 1), "--ckpt-step 1 picks a checkpoint of --load DIR")


def test_with_no_valid_checkpoint_the_refusal_lists_each_and_starting_afresh_works(ckpt, tmp_path):
    root = saved(tmp_path / "save")
    for step in (1, 2):
        truncate(os.path.join(root, f"iter_{step:07d}", checkpointing.LOOP_STATE), 3)
    refused(args_for(ckpt, tmp_path, "--load", root, *MTP), f"--load {root}: no valid checkpoint there: iter_0000002 (",
            "; iter_0000001 (loop_state.json has 3 bytes", "run without --load to start from --hf-checkpoint")
    prepare(load_config(args_for(ckpt, tmp_path, *MTP)))  # the advice, as written


def test_a_checkpoint_without_a_manifest_is_refused_with_the_command_that_writes_one(ckpt, tmp_path):
    root = saved(tmp_path / "save", steps=(1,))
    os.remove(os.path.join(root, "iter_0000001", "manifest.json"))
    message = refused(args_for(ckpt, tmp_path, "--load", root, *MTP), "manifest.json is missing")
    command = re.search(r"`(python -m vime\.manifest write [^`]+)`", message).group(1)
    proc = subprocess.run(shlex.split(command), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert resumes_from(ckpt, tmp_path, root) == "iter_0000001"


def full_disk(path):
    os.makedirs(path)
    open(os.path.join(path, "part"), "wb").write(b"x" * 10)
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_at_the_first_save_says_nothing_is_there_to_resume_from(tmp_path):
    with pytest.raises(checkpointing.CheckpointSaveError) as err:
        checkpointing.save(str(tmp_path), 4, full_disk, {"step": 4})
    message = str(err.value)
    assert "disk is full" in message and "removed the partial iter_0000004.tmp" in message
    assert "holds no valid checkpoint to resume from" in message and "intact" not in message, message
    assert os.listdir(tmp_path) == []


def test_a_full_disk_later_names_the_checkpoint_to_resume_from_and_that_load_works(ckpt, tmp_path):
    root = saved(tmp_path / "save")
    truncate(os.path.join(root, "iter_0000002", "model", "common.pt"), 10)  # the newest is damaged: step 1 is what is left
    with pytest.raises(checkpointing.CheckpointSaveError) as err:
        checkpointing.save(root, 3, full_disk, {"step": 3})
    advice = re.search(r"the newest valid checkpoint there is step (\d+): free space \(or choose another --save\), "
                       r"then resume with --load (\S+)$", str(err.value))
    assert advice and advice.group(1) == "1", str(err.value)
    assert resumes_from(ckpt, tmp_path, advice.group(2)) == "iter_0000001"  # the advice, as written


def test_the_manifest_tool_checks_what_load_checks(tmp_path):
    root = saved(tmp_path / "save", steps=(1,))
    iteration = os.path.join(root, "iter_0000001")
    check = [sys.executable, "-m", "vime.manifest", "check", iteration]
    assert subprocess.run(check, cwd=REPO, capture_output=True, text=True, timeout=120).returncode == 0
    flip_a_byte(os.path.join(iteration, "model", "common.pt"))
    proc = subprocess.run(check, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {iteration}: model/common.pt differs from its checksum in the manifest (its bytes changed after "
        "the save)"], proc.stderr
