"""train_rl.py's config: YAML defaults, Hydra overrides and --kebab-flags land on one dataclass tree."""
import json
import re

import pytest

from orchestration.preflight import check_config
from vime.cli_config import load_config
from vime.config import flag_table
from vime.errors import UserError


def test_every_flag_maps_to_one_field_and_equals_its_hydra_override():
    table = flag_table()
    assert len({path for path, _ in table.values()}) == len(table)
    a = load_config(["--mtp-num-layers", "1", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.5", "--lr", "3e-5"])
    b = load_config(["mtp.num_layers=1", "mtp.enable_training=true", "mtp.loss_scaling_factor=0.5", "train.lr=3e-5"])
    assert a == b
    assert (a.mtp.num_layers, a.mtp.enable_training, a.mtp.loss_scaling_factor, a.train.lr) == (1, True, 0.5, 3e-5)


def test_flags_override_hydra_which_overrides_yaml_and_presets_apply():
    cfg = load_config(["train.lr=1e-3", "--lr", "2e-3"])
    assert cfg.train.lr == 2e-3
    # the tree holds the parsed config; to_vllm() is the config as written
    assert load_config([]).rollout.vllm_speculative_config.to_vllm() == {"method": "mtp", "num_speculative_tokens": 2}
    assert load_config(["experiment=drift_none"]).rollout.vllm_speculative_config is None
    assert load_config(["--no-mtp-detach-trunk"]).mtp.detach_trunk is False
    spec = '{"method":"ngram","num_speculative_tokens":3}'
    assert load_config(["--vllm-speculative-config", spec]).rollout.vllm_speculative_config.to_vllm() == json.loads(spec)


@pytest.mark.parametrize("argv, needle", [
    (["--mtp-num-layer", "1"], "did you mean --mtp-num-layers"),
    (["foo"], "unexpected argument 'foo'"),
    (["train.lr=abc"], "could not be converted"),
    (["--lr", "fast"], "--lr expects float"),
    (["--num-rollout"], "--num-rollout needs a value"),
    (["--use-wandb", "maybe"], None),  # 'maybe' is not a bool value: the flag means true, 'maybe' is an argument
])
def test_bad_flags_are_one_line_user_errors(argv, needle):
    with pytest.raises(UserError) as err:
        load_config(argv)
    assert "\n" not in str(err.value)
    if needle:
        assert needle in str(err.value)


@pytest.mark.parametrize("argv, needle", [
    (["--enable-mtp-training"], "--enable-mtp-training needs --mtp-num-layers"),
    (["--global-batch-size", "48"], "--global-batch-size 48 must divide"),
    (["--micro-batch-size", "48"], "--micro-batch-size 48"),
    (["--save-interval", "2"], "--save-interval 2 needs --save"),
    (["--debug-train-only"], "--load-debug-rollout-data"),
    (["--draft-loss-type", "kl"], "--draft-loss-type 'kl': use one of ce, soft_ce, tv"),
    (["--draft-loss-type", "soft_ce", "--draft-distill-topk", "-1"], "--draft-distill-topk -1: must be >= 0"),
    (["--draft-distill-topk", "8"], "--draft-distill-topk truncates a distillation target"),
    (["--enable-mtp-training", "--mtp-num-layers", "1", "--mtp-train-depths", "0"], "--mtp-train-depths 0: must be >= 1"),
    (["--mtp-train-depths", "3"], "--mtp-train-depths 3 sets how the MTP layers train"),
    (["--mtp-reuse-attention", "eagle"], "--mtp-reuse-attention 'eagle': use one of drafter, megatron"),
    (["--enable-mtp-training", "--mtp-num-layers", "1", "--draft-steps-per-rollout", "0"],
     "--draft-steps-per-rollout 0: must be >= 1"),
    (["--draft-steps-per-rollout", "4"], "--draft-steps-per-rollout 4 sets how the online draft trains"),
    (["--draft-lr", "1e-3"], "--draft-lr 0.001 sets how the online draft trains"),
    (["--draft-lr-warmup-iters", "10"], "--draft-lr-warmup-iters 10 sets how the online draft trains"),
    (["--enable-mtp-training", "--mtp-num-layers", "1", "--draft-steps-per-rollout", "4", "--draft-replay-batches", "-1"],
     "--draft-replay-batches -1: must be >= 0"),
    (["--enable-mtp-training", "--mtp-num-layers", "1", "--enable-draft-training"],
     "--enable-mtp-training and --enable-draft-training each train the run's one draft"),
])
def test_validation_refuses_inconsistent_settings(argv, needle):
    with pytest.raises(UserError, match=re.escape(needle)):
        check_config(load_config(argv))


def test_every_default_comes_from_the_dataclasses_alone():
    """One source per default: the base YAML holds no value (only the composition list), and the
    composed config with no overrides is exactly the dataclasses' defaults."""
    import dataclasses

    from omegaconf import OmegaConf

    from vime.cli_config import CONFIG_DIR, compose
    from vime.config import Config

    yaml = OmegaConf.to_container(OmegaConf.load(f"{CONFIG_DIR}/config.yaml"))
    assert set(yaml) <= {"defaults", "hydra"}, f"config.yaml holds values: {sorted(set(yaml) - {'defaults', 'hydra'})}"
    assert dataclasses.asdict(compose([])) == dataclasses.asdict(Config())


def test_help_shows_every_flag_with_a_help_line_its_key_and_its_default():
    import argparse

    from vime.cli_config import build_parser, compose, help_text

    text = help_text()
    shown = {a.option_strings[0]: a.help for a in build_parser(compose([]))._actions if a.help != argparse.SUPPRESS}
    assert set(shown) == set(flag_table())
    for name, (path, f) in flag_table().items():
        assert f.metadata["help"], f"{name} has no help line"
        assert f"({path})" in shown[name] and "default" in shown[name], f"{name}: {shown[name]}"
        assert f"  {name} " in text, f"{name} missing from --help"


def test_bool_flags_take_no_value_true_false_or_the_no_prefix_and_keep_the_next_argument():
    assert load_config(["--enable-mtp-training", "mtp.num_layers=1"]).mtp.num_layers == 1
    assert load_config(["--enable-mtp-training", "mtp.num_layers=1"]).mtp.enable_training is True
    assert load_config(["--use-wandb", "false"]).run.use_wandb is False
    assert load_config(["--use-wandb=False"]).run.use_wandb is False
    assert load_config(["--no-use-wandb"]).run.use_wandb is False
    assert load_config(["--no-use-wandb", "--use-wandb"]).run.use_wandb is True  # the last one wins
    assert load_config(["--mtp-num-layers", "none"]).mtp.num_layers is None
    assert load_config(["--lr=-1"]).train.lr == -1 and load_config(["--lr", "-1"]).train.lr == -1


@pytest.mark.parametrize("argv, needle", [
    (["--spec-adaptive=maybe"], "--spec-adaptive takes true or false (got 'maybe')"),
    (["--mtp-num-layers", "two"], "--mtp-num-layers expects int (got 'two')"),
    (["--lr"], "--lr needs a value"),
    (["--mtp-num"], "unknown flag --mtp-num"),  # no abbreviations: a prefix is a typo, not a flag
    (["--rollout-temprature=1"], "did you mean --rollout-temperature"),
    (["--no-lr"], "unknown flag --no-lr"),
])
def test_more_bad_flags_are_one_line_user_errors(argv, needle):
    with pytest.raises(UserError) as err:
        load_config(argv)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_trainer_config_defaults_are_the_config_trees():
    from dataclasses import fields

    from trainer.config import TrainerConfig
    from vime.config import Config

    tree = flag_table()  # every `section.field` of the schema, independent of trainer/config.py
    keys = {path for path, _ in tree.values()}
    schema, trainer = Config(), TrainerConfig()
    for f in fields(TrainerConfig):
        key = f.metadata.get("tree_key")
        assert key in keys, f"TrainerConfig.{f.name} reads no field of the config tree"
        section, name = key.split(".")
        assert getattr(trainer, f.name) == getattr(getattr(schema, section), name), f"TrainerConfig.{f.name} vs {key}"


def test_trainer_config_from_the_tree_carries_every_flag():
    from trainer.config import TrainerConfig

    cfg = load_config(["--lr", "3e-5", "--draft-lr", "7e-3", "--kl-loss-type", "k1", "--rollout-temperature", "0.7",
                       "--enable-mtp-training", "--mtp-num-layers", "2", "--micro-batch-size", "4", "--seed", "9"])
    t = TrainerConfig.from_tree(cfg)
    assert (t.lr, t.draft_lr, t.kl_estimator, t.temperature, t.enable_mtp_training, t.mtp_num_layers,
            t.micro_batch_size, t.seed) == (3e-5, 7e-3, "k1", 0.7, True, 2, 4, 9)


def test_the_config_dump_holds_the_speculative_config_as_written_and_loads_back():
    from omegaconf import OmegaConf

    from vime.cli_config import describe

    written = {"method": "deepseek_mtp", "num_speculative_tokens": 3}
    cfg = load_config(["--vllm-speculative-config", json.dumps(written)])
    dumped = OmegaConf.to_container(OmegaConf.create(describe(cfg)))["rollout"]["vllm_speculative_config"]
    assert dumped == written  # not vime's reading of it (method 'mtp', vLLM's defaults filled in)
    hydra_dict = "{" + ",".join(f"{key}:{value}" for key, value in dumped.items()) + "}"  # Hydra's own grammar
    again = load_config([f"rollout.vllm_speculative_config={hydra_dict}"])
    assert again.rollout.vllm_speculative_config == cfg.rollout.vllm_speculative_config


def test_help_lists_every_flag_once_under_its_sections_title_and_the_switches_under_their_own():
    from dataclasses import fields

    from vime.cli_config import BENCH_DEBUG_TITLE, flag_groups, help_text
    from vime.config import Config

    groups = flag_groups()
    listed = [name for _, names in groups.values() for name in names]
    assert sorted(listed) == sorted(flag_table()) and len(listed) == len(set(listed))  # exactly one group each
    assert list(groups) == [s.name for s in fields(Config)] + [BENCH_DEBUG_TITLE]
    for title, (_, names) in groups.items():  # a section's group holds its own fields, but the switches
        assert all(flag_table()[n][0].split(".")[0] == title for n in names) or title == BENCH_DEBUG_TITLE
    assert {"--debug-rollout-only", "--debug-train-only", "--rollout-time-plain-baseline"} <= set(
        groups[BENCH_DEBUG_TITLE][1])
    text = help_text()
    starts = [text.index(f"\n{title}:\n  {description}") for title, (description, _) in groups.items()]
    assert starts == sorted(starts)  # the titles, each with its section's description, in the tree's order
    for (title, (_, names)), start, end in zip(groups.items(), starts, starts[1:] + [len(text)]):
        block = text[start:end]
        assert all(f"\n  {name} " in block or f"\n  {name}\n" in block for name in names), title


def _documented_recipe_commands():
    """The `python train_rl.py experiment=smollm2_math ...` commands docs/checkpoints.md gives (continuation lines
    joined), as argument lists."""
    import os
    import shlex

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs/checkpoints.md")
    with open(path, encoding="utf-8") as f:
        text = f.read().replace("\\\n", " ")
    return [shlex.split(line, comments=True)[2:] for line in text.splitlines()
            if line.strip().startswith("python train_rl.py experiment=smollm2_math")]


def test_the_real_model_recipe_and_its_documented_variants_pass_the_config_checks():
    """The recipe, and every variant of it the docs give (its vLLM run, which turns the MTP layer and its training
    knobs off), are settings train_rl.py takes: a knob left behind is refused in one line."""
    commands = _documented_recipe_commands()
    on_vllm = next(argv for argv in commands if "vllm" in argv)
    for argv in [["experiment=smollm2_math"], *commands]:
        check_config(load_config(argv))
    with pytest.raises(UserError, match="--draft-lr-warmup-iters 10 sets how the online draft trains"):
        check_config(load_config([a for a in on_vllm if a != "draft.lr_warmup_iters=0"]))
