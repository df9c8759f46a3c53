"""The drift benchmark's draft-shaping arm options: `draft_layers=N` gives that arm a draft made
by the kind's maker with N decoder layers, `draft_vocab=N` an EAGLE-3 draft predicting N tokens, each in
its own directory, while the other arms keep theirs; checked on the saved drafts' configs (what vLLM and
the engine load), not on the command built."""
import argparse
import json
import os

import pytest

from scripts.bench.lib import drift


def drift_args(out, arms, draft="dflash"):
    p = argparse.ArgumentParser()
    drift.add_arguments(p)
    args = p.parse_args(["--draft", draft, "--draft-warmup-steps", "0", "--arms", arms])
    args.out, args.steps, args.extra, args.reuse = str(out), 1, [], False
    return args


def saved_config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def test_draft_layers_makes_that_arm_a_deeper_draft_in_its_own_directory(tmp_path):
    arms = "online:k=7,online:k=7:draft_layers=2"
    args = drift_args(tmp_path, arms)
    drift.check_args(args)
    shallow, deep = (drift.arm_checkpoints("dflash", args, 7, drift.maker_flags(arm, args))[1] for arm in arms.split(","))
    assert shallow != deep and all(p.startswith(str(tmp_path)) for p in (shallow, deep))
    assert saved_config(shallow)["num_hidden_layers"] == 1  # make_dflash_draft.py's default
    assert saved_config(deep)["num_hidden_layers"] == 2
    # both drafts serve blocks of 8 (k = 7): the block size still follows k=
    assert {saved_config(p)["block_size"] for p in (shallow, deep)} == {8}
    assert drift.group_name(arms.split(",")[1], args) != drift.group_name(arms.split(",")[0], args)


def test_draft_vocab_makes_that_arm_an_eagle3_draft_of_a_reduced_vocabulary_in_its_own_directory(tmp_path):
    arms = "online,frozen:draft_vocab=12"
    args = drift_args(tmp_path, arms, draft="eagle3")
    drift.check_args(args)
    whole, reduced = (drift.arm_checkpoints("eagle3", args, 3, drift.maker_flags(arm, args))[1]
                      for arm in arms.split(","))
    assert whole != reduced and all(p.startswith(str(tmp_path)) for p in (whole, reduced))
    assert saved_config(whole)["draft_vocab_size"] == saved_config(whole)["vocab_size"] == 32  # the maker's default
    assert saved_config(reduced)["draft_vocab_size"] == 12
    assert drift.group_name(arms.split(",")[1], args) == "eagle3 k=3 draft_vocab=12"
    with pytest.raises(drift.UserError, match="the dflash draft takes no draft_vocab= option"):
        drift.check_args(drift_args(tmp_path, "online:draft_vocab=12"))


def test_a_run_of_none_arms_needs_no_draft_and_a_drafting_arm_on_the_same_target_is_refused(tmp_path):
    """tiny-qwen2 has no MTP layers: the `none` arm (no speculation, either backend) runs on it as it is, an MTP
    arm without --draft-warmup-steps gets the one line saying how to add fresh layers."""
    p = argparse.ArgumentParser()
    drift.add_arguments(p)
    none = p.parse_args(["--draft", "mtp", "--hf-checkpoint", "checkpoints/tiny-qwen2", "--arms", "none"])
    drift.check_args(none)
    online = p.parse_args(["--draft", "mtp", "--hf-checkpoint", "checkpoints/tiny-qwen2", "--arms", "online,none"])
    with pytest.raises(drift.UserError, match="has no mtp layers: give --draft-warmup-steps"):
        drift.check_args(online)
