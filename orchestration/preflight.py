"""The checks a run makes before any actor starts, in the order they run: each part checks its own
(a config section its fields, a registry its names, a backend its engine's needs, the trainer its
draft), so this module only says what runs when, and each check runs once. Nothing here changes the
config or the disk: those steps are orchestration/run_setup.py's, and train_rl.py `prepare` interleaves the two.
A failed check is one `UserError` line (train_rl.py prints `error: ...` and exits 2)."""
import os

from vime.errors import UserError, require


def check_config(cfg):
    """The checks that read no file, once each, from the config down to each part: the tree's own ranges and
    combinations, the speculative config with vime's speculation flags, the device, the rollout's, the
    trainer's and the placement's names and knobs; last, whether each knob set is used by this run."""
    from orchestration.placement import check_placement_flags
    from orchestration.ray_connect import check_ray_address_env
    from rollout.advantages import check_estimator
    from rollout.group_batching import check_dynamic_sampling
    from rollout.task import check_task_variant
    from trainer.drafts import check_draft_training
    from trainer.losses import check_kl_estimator
    from trainer.optimizer import check_device_options
    from trainer.weight_senders import check_weight_transfer
    from vime.config import check_knob_switches, validate
    from vime.precision import check_bf16
    from vime.spec_config import check_run_rules

    validate(cfg)
    check_run_rules(cfg.rollout)
    check_bf16(cfg.model.bf16)  # --bf16 on a device that cannot run a bf16 matmul
    check_device_options(cfg.train)  # an optimizer option this machine's megatron-core cannot run
    check_dynamic_sampling(cfg.rollout)
    check_task_variant(cfg.rollout)
    check_estimator(cfg.train.advantage_estimator)
    check_kl_estimator(cfg.train.kl_loss_type)
    check_weight_transfer(cfg.rollout)
    check_draft_training(cfg)
    check_placement_flags(cfg)
    check_ray_address_env(cfg.run.ray_address)
    check_knob_switches(cfg)  # last: a knob's own value is judged before whether this run would use it


def check_inputs(cfg):
    """The checks that read the checkpoint, the draft and the output directories; returns the
    checkpoint's ModelConfig (for `check_prompts`). --load is checked once run_setup has chosen the
    checkpoint (`check_resume`)."""
    from rollout.backend import check_backend
    from trainer.model import check_recompute
    from vime.models.activations import RecomputePlan
    from trainer.drafts import check_draft_files
    from trainer.routing_replay import check_routing_replay
    from vime.models.config_checks import check_finite_weights, check_mtp_layers, run_model_config
    from vime.models.hf_format import inspect_hf_checkpoint
    from vime.models.trainable import check_trainable
    from vime.paths import require_writable_dir

    hf = inspect_hf_checkpoint(cfg.model.hf_checkpoint)
    check_mtp_layers(cfg.mtp.num_layers, hf, cfg.model.hf_checkpoint, training=cfg.mtp.enable_training)
    hf = run_model_config(cfg.mtp, hf)  # with the fresh MTP layers run_setup adds, where it adds them
    cfg.train.layout.check_model(hf)
    check_recompute(cfg.train.layout, hf, RecomputePlan.of(cfg.train))
    check_trainable(hf)
    check_routing_replay(cfg, hf)
    check_backend(cfg, hf)
    check_draft_files(cfg)  # after the backend found the draft's directory a draft of its kind
    check_finite_weights(os.path.join(cfg.model.hf_checkpoint, "model.safetensors"))
    for flag, path in (("--save", cfg.run.save), ("--output-dir", cfg.run.output_dir)):
        if path:  # before anything is written there (the task variant's prompts, the run's files)
            require_writable_dir(path, flag)
    return hf


def check_prompts(cfg, hf):
    """The prompt files against the tokenizer and the context of `hf`, and the reward function (a run
    that only trains on saved rollouts reads neither)."""
    from rollout.data import check_prompt_files
    from rollout.rewards import get_reward_fn

    if cfg.run.debug_train_only:
        return
    check_prompt_files(cfg.rollout, cfg.model.hf_checkpoint, hf)
    get_reward_fn(cfg.rollout.rm_type, cfg.rollout.custom_rm_path)


def check_resume(cfg, hf):
    """The checkpoint --load resumes from (an iteration directory, chosen and verified by
    run_setup.choose_checkpoint) has steps left to run, matches the MTP and draft flags, and holds the
    tensors --hf-checkpoint's config (`hf`) implies, the trainer's MTP layers included."""
    from trainer.drafts import saved_draft_state_file
    from vime.checkpointing import load_loop_state
    from vime.models.torch_dist_format import read_saved_meta, torch_dist_tensor_problem

    iteration = cfg.run.load
    step = load_loop_state(iteration)["step"]
    require(step < cfg.run.num_rollout,
            f"--load {iteration}: the checkpoint is at step {step}, which already reaches --num-rollout "
            f"{cfg.run.num_rollout}; raise --num-rollout to train further")
    meta = read_saved_meta(os.path.join(iteration, "model"))
    trained = meta.get("mtp_trained")  # the optimizer has an MTP param group exactly when it was trained
    if trained is not None and trained != cfg.mtp.enable_training:
        how = (f"--enable-mtp-training --mtp-num-layers {meta.get('mtp_num_layers')}" if trained
               else "no --enable-mtp-training")
        raise UserError(f"--load {iteration}: the checkpoint was trained with"
                        f"{'' if trained else 'out'} MTP training; resume with the same flags ({how})")
    draft_file = saved_draft_state_file(os.path.join(iteration, "model"))
    require((draft_file is not None) == cfg.draft.enable_training,
            f"--load {iteration}: the checkpoint was saved with{'' if draft_file else 'out'} "
            "--enable-draft-training; resume with the same flags")
    n = hf.num_nextn_predict_layers if cfg.mtp.num_layers is None else cfg.mtp.num_layers  # what the trainer builds
    require(n <= meta.get("mtp_num_layers", 0),
            f"--load {iteration}: the checkpoint has {meta.get('mtp_num_layers', 0)} MTP layers, fewer than the run's "
            f"{n} (--mtp-num-layers, else --hf-checkpoint's); resume with --mtp-num-layers {meta.get('mtp_num_layers', 0)}")
    family = (meta.get("model_config") or {}).get("family", hf.family)
    require(family == hf.family, f"--load {iteration}: the checkpoint holds a {family} model and --hf-checkpoint "
            f"{cfg.model.hf_checkpoint} is {hf.family}; resume with the --hf-checkpoint the run started from")
    problem = torch_dist_tensor_problem(meta, hf, n)
    require(problem is None, f"--load {iteration}: its tensors disagree with --hf-checkpoint {cfg.model.hf_checkpoint}'s "
            f"config.json: {problem}; resume with the --hf-checkpoint the run started from")
