"""One rule for every knob that a run would ignore: a knob set away from its default is refused in one
line when the part of the run or the feature it tunes is off (a section's NEEDS, vime/config.py
SWITCHES): a draft knob without draft training, a trainer feature under --debug-rollout-only, a
rollout one under --debug-train-only, the KL coefficient without --use-kl-loss, ... The same knob
with its switch on is the control. Knobs whose large values can only cost memory and time are
bounded by what the run drafts, each bound said in --help."""
import copy
import dataclasses
import typing

import pytest

from orchestration.preflight import check_config
from tests.bad_input_helpers import refused
from tests.test_bad_inputs import args_for, ckpt  # noqa: F401  (ckpt: the bad-input tests' fixture)
from train_rl import prepare
from vime.cli_config import help_text, load_config
from vime.config import SWITCHES, check_knob_switches, knob_needs
from vime.errors import UserError

# the fields that turn each switch off / on in a run that is otherwise the defaults
SWITCH_SETTINGS = {
    "trainers": ({"run.debug_rollout_only": True}, {}),
    "rollout": ({"run.debug_train_only": True, "run.load_debug_rollout_data": "/rollouts"}, {}),
    "sync": ({"run.debug_rollout_only": True}, {}),
    "train_only": ({}, {"run.debug_train_only": True, "run.load_debug_rollout_data": "/rollouts"}),
    "draft_training": ({}, {"mtp.enable_training": True, "mtp.num_layers": 1}),
    "mtp_training": ({}, {"mtp.enable_training": True, "mtp.num_layers": 1}),
    "kl_loss": ({}, {"train.use_kl_loss": True}),
    "tis": ({}, {"train.use_tis": True}),
    "dynamic_sampling": ({}, {"rollout.dynamic_sampling": True}),
    "eval": ({}, {"rollout.eval_prompt_data": "/eval.jsonl"}),
    "task_variant": ({}, {"rollout.task_variant": "longtail"}),
    "save": ({}, {"run.save": "/save"}),
    "load": ({}, {"run.load": "/save"}),
    "ray_address": ({}, {"run.ray_address": "127.0.0.1:6379"}),
    "cpu_offload": ({}, {"train.optimizer_cpu_offload": True}),
    "precision_aware": ({}, {"train.use_precision_aware_optimizer": True}),
    "full_recompute": ({}, {"train.recompute_granularity": "full"}),
}
# a value other than the default for the knobs whose type alone does not give one
CHOSEN = {"--kl-loss-type": "k1", "--draft-loss-type": "tv", "--mtp-reuse-attention": "megatron",
          "--vllm-weight-transfer": "nccl", "--task-variant": "longtail", "--eval-prompt-data": "/eval.jsonl",
          "--save": "/save", "--load": "/save", "--save-debug-rollout-data": "/rollouts",
          "--load-debug-rollout-data": "/rollouts", "--main-grads-dtype": "bf16", "--exp-avg-dtype": "bf16",
          "--exp-avg-sq-dtype": "bf16", "--recompute-method": "block"}


def other_value(name, f):
    """A value of field `f` other than its default (and inside its range)."""
    if name in CHOSEN:
        return CHOSEN[name]
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    kind = next((t for t in typing.get_args(f.type) if t is not type(None)), f.type)
    if kind is bool:
        return not default
    if default is None:
        return kind(1)
    return default + 1 if kind is int else default * 2 or 0.5


@pytest.fixture(scope="module")
def defaults():
    return load_config([])


def with_values(base, settings):
    cfg = copy.deepcopy(base)
    for path, value in settings.items():
        section, key = path.split(".")
        setattr(getattr(cfg, section), key, value)
    return cfg


KNOBS = sorted(knob_needs().items())


def test_every_knob_names_a_switch_and_every_switch_is_needed_and_testable():
    needed = {need for _, (_, _, need) in KNOBS}
    assert needed == set(SWITCHES) == set(SWITCH_SETTINGS)


@pytest.mark.parametrize("name, needs", [(n, v[2]) for n, v in KNOBS], ids=[n for n, _ in KNOBS])
def test_a_knob_whose_switch_is_off_is_refused_naming_it_and_passes_with_the_switch_on(defaults, name, needs):
    off, on = SWITCH_SETTINGS[needs]
    path, f, _ = knob_needs()[name]
    knob = {path: other_value(name, f)}
    with pytest.raises(UserError) as err:
        check_knob_switches(with_values(defaults, {**off, **knob}))
    message = str(err.value)
    assert message.startswith(name) and "\n" not in message, message
    why = SWITCHES[needs].why
    assert (why if isinstance(why, str) else why(with_values(defaults, off))) in message
    check_knob_switches(with_values(defaults, {**on, **knob}))  # the control


@pytest.mark.parametrize("extra, needle", [
    (["--use-rollout-routing-replay", "--debug-rollout-only"],
     "--use-rollout-routing-replay acts on the trainers, and --debug-rollout-only starts none"),
    (["--draft-loss-type", "tv"], "--draft-loss-type tv sets how the online draft trains: use it with "
                                  "--enable-mtp-training (the MTP layers) or --enable-draft-training"),
    (["--draft-clip-grad", "0.5"], "--draft-clip-grad 0.5 sets how the online draft trains"),
    (["--draft-loss-scaling-factor", "2"], "--draft-loss-scaling-factor 2.0 sets how the online draft trains"),
    (["--save", "/tmp/vime_never", "--debug-rollout-only"], "--save /tmp/vime_never acts on the trainers"),
    (["--check-weight-update-equal", "--debug-rollout-only"], "--check-weight-update-equal acts on the trainers "
                                                              "and the rollout together, and --debug-rollout-only"),
])
def test_the_reported_knobs_without_effect_are_refused_before_any_actor(ckpt, tmp_path, extra, needle):
    refused(args_for(ckpt, tmp_path, *extra), needle)


def test_a_knobs_own_value_is_judged_before_whether_the_run_uses_it():
    with pytest.raises(UserError, match="--kl-loss-type 'k9'"):
        check_config(load_config(["--kl-loss-type", "k9"]))


@pytest.mark.parametrize("extra, needle, fits", [
    (["--enable-mtp-training", "--mtp-num-layers", "1", "--mtp-train-depths", "3"],
     "--mtp-train-depths 3: the rollout drafts num_speculative_tokens 2 tokens a step with 1 MTP layers",
     "--mtp-train-depths 2"),
    (["--enable-mtp-training", "--mtp-num-layers", "1", "--draft-steps-per-rollout", "4", "--draft-replay-batches", "9"],
     "--draft-replay-batches 9: the mtp draft's --draft-steps-per-rollout 4 takes 3 draft-only steps",
     "--draft-replay-batches 2"),
])
def test_a_knob_past_what_the_run_drafts_is_refused_with_the_bound_and_the_bound_passes(ckpt, tmp_path, extra, needle,
                                                                                        fits):
    message = refused(args_for(ckpt, tmp_path, *extra), needle, f"pass {fits} or less")
    flag, value = fits.split()
    prepare(load_config(args_for(ckpt, tmp_path, *extra, flag, value))).release()  # the advice, as written
    assert message


def test_help_states_each_bound():
    text = "".join(help_text().split())  # argparse wraps lines, at hyphens too
    for bound in ("at most num_speculative_tokens (the drafts the rollout asks for",
                  "at most num_speculative_tokens or --mtp-num-layers, whichever is larger",
                  "at most --draft-steps-per-rollout - 2"):
        assert "".join(bound.split()) in text, bound
