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


def test_every_online_arm_gets_its_end_ratios_over_the_first_frozen_and_none_arms(capsys):
    """Two online arms of one draft group (one draft step a rollout, and eight) each get the end ratio of their
    last-window acceptance length and tokens/s over the frozen and none arms', the written-out means' quotients."""
    def rows(accept, rate):
        return [{"step": s, "reward": 0.5, "num_samples": 32, "response_len": 10, "rollout_time": 1.0,
                 "spec_accept_length": a, "rollout_tokens_per_s": r} for s, (a, r) in enumerate(zip(accept, rate))]
    arms = {"embedded/online:steps=1": rows([1.0, 1.8, 2.0], [100, 110, 120]),
            "embedded/online:steps=8": rows([1.0, 2.1, 2.3], [100, 130, 150]),
            "embedded/frozen": rows([1.0, 1.5, 1.7], [100, 100, 140]),
            "embedded/none": rows([1.0, 1.0, 1.0], [100, 125, 125])}
    groups = dict.fromkeys(arms, "dspark k=3")
    for base, labels in drift.backend_groups(arms, groups).items():
        drift.print_comparisons("embedded, dspark k=3", labels, arms, 2)
    out = capsys.readouterr().out
    end = {label: ((r[1]["spec_accept_length"] + r[2]["spec_accept_length"]) / 2,
                   (r[1]["rollout_tokens_per_s"] + r[2]["rollout_tokens_per_s"]) / 2) for label, r in arms.items()}
    for online in ("online:steps=1", "online:steps=8"):
        for other in ("frozen", "none"):
            mine, theirs = end[f"embedded/{online}"], end[f"embedded/{other}"]
            assert (f"end ratio {online} / {other}: rollout tokens/s {mine[1] / theirs[1]:.2f}x, "
                    f"acceptance length {mine[0] / theirs[0]:.2f}x") in out
