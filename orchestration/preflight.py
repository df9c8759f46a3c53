"""Every check a run makes before any actor starts: config, files, checkpoint, reward, speculative
config against the checkpoint and the backend. A failed check is one `error:` line and exit 2."""
import os
import sys

from vime.errors import UserError, require


def preflight(cfg):
    """Every check that needs no actor: config, files, reward, speculative config vs checkpoint."""
    from vime.models.config_checks import check_finite_weights
    from vime.models.hf_format import inspect_hf_checkpoint
    from rollout.advantages import check_estimator
    from rollout.data import read_prompt_file
    from rollout.rewards import get_reward_fn
    from trainer.distributed import check_parallel_sizes
    from trainer.losses import check_kl_estimator
    from trainer.model import check_tensor_parallel
    from vime.config import validate

    validate(cfg)
    check_kl_estimator(cfg.train.kl_loss_type)
    check_estimator(cfg.train.advantage_estimator)
    ensure_model(cfg.model)
    hf = inspect_hf_checkpoint(cfg.model.hf_checkpoint)
    require(cfg.mtp.num_layers is None or cfg.mtp.num_layers <= hf.num_nextn_predict_layers,
            f"--mtp-num-layers {cfg.mtp.num_layers}: {cfg.model.hf_checkpoint} has only "
            f"{hf.num_nextn_predict_layers} MTP layers")
    # The rollout drafts with every MTP layer of the checkpoint; training fewer would leave the
    # rest stale in the draft and the sync guard could never match the trainer's draft.
    require(cfg.mtp.num_layers is None or cfg.mtp.num_layers >= hf.num_nextn_predict_layers,
            f"--mtp-num-layers {cfg.mtp.num_layers}: {cfg.model.hf_checkpoint} has {hf.num_nextn_predict_layers} "
            f"MTP layers and the rollout drafts with all of them; pass --mtp-num-layers "
            f"{hf.num_nextn_predict_layers}, or keep the first {cfg.mtp.num_layers} with checkpoint_convert.hf_to_torch_dist "
            f"--mtp-num-layers {cfg.mtp.num_layers} and torch_dist_to_hf")
    t = cfg.train
    check_parallel_sizes(t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.data_parallel_size,
                         t.tensor_model_parallel_size, t.pipeline_model_parallel_size)
    check_tensor_parallel(hf, t.tensor_model_parallel_size)
    check_rollout_backend(cfg, hf)
    check_finite_weights(os.path.join(cfg.model.hf_checkpoint, "model.safetensors"))
    from vime.paths import require_writable_dir

    for flag, path in (("--save", cfg.run.save), ("--output-dir", cfg.run.output_dir)):
        if path:  # before anything is written there (the task variant's prompts, the run's files)
            require_writable_dir(path, flag)
    if cfg.rollout.task_variant is not None:
        cfg.rollout.prompt_data = write_variant_prompts(cfg.rollout, cfg.run.output_dir)
    if cfg.rollout.prompt_data is None:
        cfg.rollout.prompt_data = os.path.join(cfg.model.hf_checkpoint, "train.jsonl")
    if not cfg.run.debug_train_only:
        codec = _codec(cfg.model.hf_checkpoint)
        check_chat_template(cfg.rollout, codec, cfg.model.hf_checkpoint)
        read_prompt_file(cfg.rollout.prompt_data, cfg.rollout.input_key, cfg.rollout.label_key,
                         codec=codec, apply_chat_template=cfg.rollout.apply_chat_template)
        if cfg.rollout.eval_prompt_data is not None:
            read_prompt_file(cfg.rollout.eval_prompt_data, cfg.rollout.input_key, cfg.rollout.label_key, codec=codec,
                             apply_chat_template=cfg.rollout.apply_chat_template, flag="--eval-prompt-data")
        get_reward_fn(cfg.rollout.rm_type, cfg.rollout.custom_rm_path)
    if cfg.run.load:
        check_resume(cfg)


def _codec(hf_checkpoint):
    from rollout.tokenizer import TextCodec

    has = os.path.isfile(os.path.join(hf_checkpoint, "tokenizer.json"))
    require(has, f"--hf-checkpoint {hf_checkpoint}: tokenizer.json is missing; RL prompts are text")
    return TextCodec(hf_checkpoint)


def check_chat_template(rollout_cfg, codec, hf_checkpoint):
    """--apply-chat-template needs a tokenizer that carries a chat template (no silent plain text)."""
    require(not rollout_cfg.apply_chat_template or codec.has_chat_template,
            f"--apply-chat-template: the tokenizer of {hf_checkpoint} has no chat template "
            "(tokenizer_config.json 'chat_template'); drop the flag and give plain-text prompts, or use a chat model")


def check_spec_fits(spec, hf, rollout_cfg):
    """Drafts per verify step must fit the context next to a prompt and the response budget."""
    if spec is None:
        return
    room = hf.max_position_embeddings - 2
    require(spec.num_speculative_tokens <= room,
            f"--vllm-speculative-config: num_speculative_tokens {spec.num_speculative_tokens} exceeds the "
            f"model's context ({hf.max_position_embeddings} positions); use at most "
            f"{min(room, rollout_cfg.rollout_max_response_len)}")


def check_resume(cfg):
    """--load: the checkpoint is complete, has steps left to run, and matches the MTP flags."""
    import json

    from vime.checkpointing import check_loadable

    step, iteration = check_loadable(cfg.run.load)
    require(step < cfg.run.num_rollout,
            f"--load {cfg.run.load}: the checkpoint is at step {step}, which already reaches --num-rollout "
            f"{cfg.run.num_rollout}; raise --num-rollout to train further")
    meta_file = os.path.join(iteration, "model", "vime_meta.json")
    require(os.path.isfile(meta_file), f"--load {cfg.run.load}: {meta_file} is missing; the checkpoint is incomplete")
    with open(meta_file) as f:
        meta = json.load(f)
    trained = meta.get("mtp_trained")  # the optimizer has an MTP param group exactly when it was trained
    if trained is not None and trained != cfg.mtp.enable_training:
        how = (f"--enable-mtp-training --mtp-num-layers {meta.get('mtp_num_layers')}" if trained
               else "no --enable-mtp-training")
        raise UserError(f"--load {cfg.run.load}: the checkpoint was trained with"
                        f"{'' if trained else 'out'} MTP training; resume with the same flags ({how})")
    n = cfg.mtp.num_layers
    require(n is None or n <= meta.get("mtp_num_layers", 0),
            f"--load {cfg.run.load}: the checkpoint has {meta.get('mtp_num_layers', 0)} MTP layers, "
            f"fewer than --mtp-num-layers {n}")


def check_rollout_backend(cfg, hf):
    """The speculative config per backend: vime's own validation for the embedded engine,
    vLLM's (run in this process, before any actor starts) for --rollout-backend vllm."""
    from rollout.backend import BACKENDS
    from rollout.spec_config import check_against_checkpoint, check_spec_adaptive, parse_spec_config, require_lossless

    r = cfg.rollout
    require(r.backend in BACKENDS, f"--rollout-backend {r.backend!r}: choose one of {', '.join(BACKENDS)}")
    if r.backend == "embedded":
        spec = parse_spec_config(r.vllm_speculative_config)
        check_spec_adaptive(spec, r.spec_adaptive)
        check_against_checkpoint(spec, hf)
        check_spec_fits(spec, hf, r)
        require_lossless(spec, where="train_rl.py")
        return
    require(not r.spec_adaptive, "--spec-adaptive is the embedded engine's; on vLLM put "
            "num_speculative_tokens_per_batch_size in --vllm-speculative-config")
    require(not r.time_plain_baseline, "--rollout-time-plain-baseline times the embedded engine without drafts; "
            "vLLM cannot switch speculation off in place: drop the flag or use --rollout-backend embedded")
    from rollout.vllm.backend import check_speculative_config, spec_dict

    raw = spec_dict(r.vllm_speculative_config)
    require(not raw or raw.get("rejection_sample_method") != "synthetic",
            "--vllm-speculative-config: rejection_sample_method 'synthetic' is benchmark-only (its outputs do not "
            "follow the policy), so train_rl.py refuses it")
    check_speculative_config(cfg.model.hf_checkpoint, raw, r.rollout_max_batch_size)


def write_variant_prompts(rollout_cfg, output_dir):
    """--task-variant: that variant's prompt set (seeded by --rollout-seed) as JSONL in the run's directory."""
    from rollout.task import TASK_VARIANTS, write_jsonl

    variant = rollout_cfg.task_variant
    require(variant in TASK_VARIANTS, f"--task-variant {variant!r}: choose one of {', '.join(sorted(TASK_VARIANTS))}")
    require(rollout_cfg.prompt_data is None, f"--task-variant {variant} makes the prompts; drop --prompt-data "
            f"{rollout_cfg.prompt_data} or the variant")
    require(rollout_cfg.task_variant_prompts >= 1,
            f"--task-variant-prompts must be >= 1 (got {rollout_cfg.task_variant_prompts})")
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, f"prompts_{variant}.jsonl")
    write_jsonl(TASK_VARIANTS[variant].prompts(rollout_cfg.task_variant_prompts, rollout_cfg.rollout_seed), path)
    return path


def ensure_model(model_cfg):
    """Re-make the tiny model if its shipped copy (the default path) was deleted (only that path)."""
    from vime.config import DEFAULT_TINY_MODEL

    path = model_cfg.hf_checkpoint
    if os.path.isdir(path) or not model_cfg.make_tiny_model_if_missing:
        return
    require(os.path.abspath(path) == os.path.abspath(DEFAULT_TINY_MODEL),
            f"--hf-checkpoint {path}: no such directory")
    import subprocess

    print(f"[vime] {path} is missing: pretraining the tiny model into it (once; about 25 minutes on 2 cores)",
          flush=True)
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "make_tiny_model.py")
    subprocess.run([sys.executable, script, "--out", path], check=True)
