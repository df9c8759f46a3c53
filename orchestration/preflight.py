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
    from rollout.group_batching import check_dynamic_sampling
    from orchestration.placement import check_placement_flags
    from rollout.rewards import get_reward_fn
    from trainer.distributed import check_parallel_sizes
    from trainer.losses import check_kl_estimator
    from trainer.model import check_tensor_parallel
    from vime.config import validate
    from vime.precision import check_bf16

    validate(cfg)
    check_bf16(cfg.model.bf16)  # --bf16 on a device that cannot run a bf16 matmul
    absolute_paths(cfg)
    check_dynamic_sampling(cfg.rollout)
    check_off_policy(cfg)
    check_placement_flags(cfg)
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
    check_draft_training(cfg)
    check_finite_weights(os.path.join(cfg.model.hf_checkpoint, "model.safetensors"))
    check_weight_shapes(cfg.model.hf_checkpoint, hf)
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
        prompts = read_prompt_file(cfg.rollout.prompt_data, cfg.rollout.input_key, cfg.rollout.label_key,
                                   codec=codec, apply_chat_template=cfg.rollout.apply_chat_template)
        check_response_fits(prompts, codec, hf, cfg.rollout)
        if cfg.rollout.eval_prompt_data is not None:
            read_prompt_file(cfg.rollout.eval_prompt_data, cfg.rollout.input_key, cfg.rollout.label_key, codec=codec,
                             apply_chat_template=cfg.rollout.apply_chat_template, flag="--eval-prompt-data")
        get_reward_fn(cfg.rollout.rm_type, cfg.rollout.custom_rm_path)
    if cfg.run.load:
        check_resume(cfg)


def check_weight_shapes(hf_checkpoint, hf):
    """Every tensor of model.safetensors has the shape config.json implies (read from the header; the
    expected shapes from the model built on the meta device, so nothing is allocated)."""
    import torch
    from safetensors import safe_open

    from rollout.embedded.model import CausalLMWithMTP
    from vime.models.families import from_canonical

    with torch.device("meta"):
        canonical = CausalLMWithMTP(hf).state_dict()
    expected = from_canonical(canonical, hf.model_family.mtp_layout, hf.num_hidden_layers, hf.num_nextn_predict_layers)
    weights = os.path.join(hf_checkpoint, "model.safetensors")
    with safe_open(weights, framework="pt") as f:
        for name in sorted(set(f.keys()) & set(expected)):
            have, want = tuple(f.get_slice(name).get_shape()), tuple(expected[name].shape)
            require(have == want, f"{weights}: tensor {name} has shape {list(have)} but config.json implies "
                    f"{list(want)}; the weights and config.json disagree (fix config.json or re-convert)")


def absolute_paths(cfg):
    """Paths the actors open, made absolute here: actors run in the job's working_dir copy, not in
    the driver's directory, so a relative --save would land inside Ray's temp dir."""
    for section, name in (("model", "hf_checkpoint"), ("rollout", "prompt_data"), ("rollout", "eval_prompt_data"),
                          ("run", "save"), ("run", "load"),
                          ("run", "load_debug_rollout_data"), ("run", "save_debug_rollout_data")):
        value = getattr(getattr(cfg, section), name)
        if value:
            setattr(getattr(cfg, section), name, os.path.abspath(value))
    absolute_draft_path(cfg.rollout)


def absolute_draft_path(rollout_cfg):
    """An external draft's `model` in --vllm-speculative-config, made absolute like the paths above
    (the rollout workers and the trainers that train it open it from the job's working_dir)."""
    import json

    spec = rollout_cfg.vllm_speculative_config
    try:  # a malformed config is reported by the backend's own check, with the flag's name
        spec = json.loads(spec) if isinstance(spec, str) and spec.strip() else dict(spec or {})
    except (ValueError, TypeError):
        return
    if isinstance(spec, dict) and isinstance(spec.get("model"), str) and not os.path.isabs(spec["model"]):
        spec["model"] = os.path.abspath(spec["model"])
        rollout_cfg.vllm_speculative_config = json.dumps(spec)


def check_off_policy(cfg):
    """--async-rollout overlaps the rollout with training, so it needs both (--tis-clip's range is in RANGES)."""
    run = cfg.run
    require(not (run.async_rollout and run.debug_rollout_only),
            "--async-rollout overlaps the rollout with training, and --debug-rollout-only starts no trainers: "
            "drop one of them")
    require(not (run.async_rollout and run.debug_train_only),
            "--async-rollout overlaps the rollout with training, and --debug-train-only generates nothing: "
            "drop one of them")


def _codec(hf_checkpoint):
    from rollout.tokenizer import codec_or_none

    codec = codec_or_none(hf_checkpoint)
    require(codec is not None, f"--hf-checkpoint {hf_checkpoint}: tokenizer.json is missing; RL prompts are text")
    return codec


def check_response_fits(prompts, codec, hf, rollout_cfg):
    """The longest prompt plus --rollout-max-response-len fits the model's context (else responses
    would be cut at the context silently, shorter than the flag says)."""
    chat = rollout_cfg.apply_chat_template
    longest = max(len(codec.prompt_ids(prompt, hf.bos_token_id, chat)) for prompt, _ in prompts)
    total = longest + rollout_cfg.rollout_max_response_len
    require(total <= hf.max_position_embeddings,
            f"--rollout-max-response-len {rollout_cfg.rollout_max_response_len}: with the longest prompt "
            f"({longest} tokens) that is {total} positions, beyond the model's context of "
            f"{hf.max_position_embeddings}; use --rollout-max-response-len "
            f"{max(hf.max_position_embeddings - longest, 1)} or less")


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
    from trainer.draft import DRAFT_STATE_FILE

    draft_file = os.path.join(iteration, "model", DRAFT_STATE_FILE)
    require(os.path.isfile(draft_file) == cfg.draft.enable_training,
            f"--load {cfg.run.load}: the checkpoint was saved with{'' if os.path.isfile(draft_file) else 'out'} "
            "--enable-draft-training; resume with the same flags")
    n = cfg.mtp.num_layers
    require(n is None or n <= meta.get("mtp_num_layers", 0),
            f"--load {cfg.run.load}: the checkpoint has {meta.get('mtp_num_layers', 0)} MTP layers, "
            f"fewer than --mtp-num-layers {n}")


def check_rollout_backend(cfg, hf):
    """The speculative config per backend: vime's own validation for the embedded engine,
    vLLM's (run in this process, before any actor starts) for --rollout-backend vllm."""
    from rollout.backend import BACKENDS
    from rollout.spec_config import (check_against_checkpoint, check_eagle3_draft, check_spec_adaptive,
                                     parse_spec_config, require_lossless)

    r = cfg.rollout
    require(r.backend in BACKENDS, f"--rollout-backend {r.backend!r}: choose one of {', '.join(BACKENDS)}")
    check_weight_transfer(r)
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
    if raw and raw.get("method") == "eagle3":
        check_eagle3_draft(raw.get("model"), hf)
    require(not raw or raw.get("rejection_sample_method") != "synthetic",
            "--vllm-speculative-config: rejection_sample_method 'synthetic' is benchmark-only (its outputs do not "
            "follow the policy), so train_rl.py refuses it")
    from vime.precision import compute_dtype

    check_speculative_config(cfg.model.hf_checkpoint, raw, r.rollout_max_batch_size, dtype=compute_dtype(cfg.model.bf16))


def check_weight_transfer(rollout_cfg):
    """--vllm-weight-transfer: a known transport, and nccl only into vLLM (it is vLLM's engine)."""
    from trainer.weight_senders import SENDERS

    t = rollout_cfg.vllm_weight_transfer
    require(t in SENDERS, f"--vllm-weight-transfer {t!r}: choose one of {', '.join(SENDERS)}")
    require(t == "reload" or rollout_cfg.backend == "vllm",
            f"--vllm-weight-transfer {t} is vLLM's weight transfer engine: use it with --rollout-backend vllm")


def check_draft_training(cfg):
    """--enable-draft-training trains an external EAGLE-3 draft: the speculative config must name one."""
    import json

    from mtp.loss import MTP_LOSSES

    d = cfg.draft
    require(d.loss_type in MTP_LOSSES, f"--draft-loss-type {d.loss_type!r}: use one of {', '.join(MTP_LOSSES)}")
    require(not d.distill_topk or d.loss_type != "ce",
            "--draft-distill-topk truncates a distillation target: use it with --draft-loss-type soft_ce or tv")
    require(d.replay_batches == 0 or d.steps_per_rollout > 1,
            "--draft-replay-batches feeds the draft-only steps: with --draft-steps-per-rollout 1 pass "
            "--draft-replay-batches 0")
    if not cfg.draft.enable_training:
        return
    value = cfg.rollout.vllm_speculative_config
    raw = json.loads(value) if isinstance(value, str) and value.strip() else (dict(value) if value else None)
    method = (raw or {}).get("method")
    require(method not in ("mtp", "deepseek_mtp", "mimo_mtp", "glm4_moe_mtp"),
            f"--enable-draft-training trains an external draft, but method {method!r} drafts with the policy's own "
            "MTP layers: train those with --enable-mtp-training --mtp-num-layers N")
    require(method == "eagle3",
            "--enable-draft-training trains an external EAGLE-3 draft: give --vllm-speculative-config "
            '\'{"method":"eagle3","model":DRAFT_DIR,"num_speculative_tokens":3}\' '
            f"(got {'no speculation' if raw is None else 'method ' + repr(method)})")


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
