"""The steps before a run that change something, each named for what it changes; train_rl.py calls
them one by one between the checks (orchestration/preflight.py), which change nothing.

- `resolve_paths`: the config's paths made absolute, the default prompt file filled in;
- `make_tiny_model_if_missing`: pretrains the shipped tiny model when its directory was deleted;
- `load_from_save_by_default`: --load set to --save when that holds a checkpoint (a requeued job resumes);
- `choose_checkpoint`: --load narrowed to the verified checkpoint it resumes from;
- `lock_run_dirs`: --output-dir and --save locked for this run (vime/run_lock.py);
- `write_variant_prompts`: a --task-variant's prompts written into the run's directory;
- `add_fresh_mtp_layers`: MTP layers added to a checkpoint that has none, warmed up, in the run's directory.
"""
import os
import subprocess
import sys

from vime.config import DEFAULT_TINY_MODEL, PATH_FIELDS, REPO_ROOT
from vime.paths import require_dir



def resolve_paths(cfg):
    """Paths the actors open, made absolute: actors run in the job's working_dir copy, not in the
    driver's directory, so a relative --save would land inside Ray's temp dir. An external draft's
    `model` in the speculative config too (the rollout workers and the trainers open it). With
    neither --prompt-data nor --task-variant, the prompts are the checkpoint's train.jsonl."""
    for section, name in PATH_FIELDS:  # the driver's own --output-dir too: one rule for all
        value = getattr(getattr(cfg, section), name)
        if value:
            setattr(getattr(cfg, section), name, os.path.abspath(value))
    r = cfg.rollout
    spec = r.vllm_speculative_config
    if spec is not None and isinstance(spec.model, str):
        r.vllm_speculative_config = spec.with_model(os.path.abspath(spec.model))
    if r.prompt_data is None and r.task_variant is None:
        r.prompt_data = os.path.join(cfg.model.hf_checkpoint, "train.jsonl")


def make_tiny_model_if_missing(model_cfg):
    """Re-make the tiny model if its shipped copy (the default path) was deleted (only that path)."""
    path = model_cfg.hf_checkpoint
    if os.path.isdir(path) or not model_cfg.make_tiny_model_if_missing:
        return
    if os.path.abspath(path) != os.path.abspath(DEFAULT_TINY_MODEL):
        require_dir(path, "--hf-checkpoint")
    print(f"[vime] {path} is missing: pretraining the tiny model into it (once; about 25 minutes on 2 cores)",
          flush=True)
    subprocess.run([sys.executable, os.path.join(REPO_ROOT, "scripts", "make_tiny_model.py"), "--out", path], check=True)


def load_from_save_by_default(run_cfg):
    """Without --load, --load is --save when that directory holds a checkpoint (a requeued job's same
    command resumes where it stopped); one line says so. A new --save starts afresh."""
    from vime.checkpointing import checkpoint_steps, latest

    if run_cfg.load or not run_cfg.save or not (checkpoint_steps(run_cfg.save) or latest(run_cfg.save)):
        return False
    print(f"[vime] --save {run_cfg.save} holds checkpoints: resuming from it (--load defaults to --save; give "
          "another --save to start afresh)", flush=True)
    run_cfg.load = run_cfg.save
    return True


def choose_checkpoint(run_cfg, by_default=False):
    """--load (and --ckpt-step) narrowed to the one checkpoint the run resumes from, every file of it
    verified against its manifest (vime/checkpointing.py `resolve_load`); one line says which newer ones
    were passed over and why. From here on --load names that iteration directory."""
    from vime.checkpointing import resolve_load

    otherwise = "give another --save to start afresh" if by_default else None
    step, iteration, skipped = resolve_load(run_cfg.load, run_cfg.ckpt_step, otherwise=otherwise)
    if skipped:
        print(f"[vime] --load {run_cfg.load}: resuming from step {step} ({os.path.basename(iteration)}), passed over: "
              f"{'; '.join(skipped)}", flush=True)
    run_cfg.load, run_cfg.ckpt_step = iteration, None


def lock_run_dirs(cfg):
    """The run's --output-dir and --save, locked until `release()` (one run at a time in each): a second
    run is refused in one line naming the first, before it writes anything there."""
    from vime.run_lock import RunLocks

    return RunLocks([("--output-dir", cfg.run.output_dir), ("--save", cfg.run.save)])


def write_variant_prompts(cfg):
    """--task-variant: that variant's prompt set (seeded by --rollout-seed) as JSONL in the run's directory,
    which becomes --prompt-data. The variant's name and flags are checked before (preflight.check_config)."""
    from rollout.task import prompt_tasks, write_jsonl

    r = cfg.rollout
    if r.task_variant is None:
        return
    os.makedirs(cfg.run.output_dir, exist_ok=True)
    path = os.path.join(cfg.run.output_dir, f"prompts_{r.task_variant}.jsonl")
    write_jsonl(prompt_tasks()[r.task_variant].prompts(r.task_variant_prompts, r.rollout_seed), path)
    r.prompt_data = path


def add_fresh_mtp_layers(cfg):
    """--enable-mtp-training --mtp-num-layers N on a checkpoint without MTP layers: N
    fresh ones, initialised as megatron-core initialises them and warmed up for --mtp-warmup-steps on the
    model's own responses to the run's prompts (scripts/make_mtp_draft.py), in the run's directory, which
    becomes --hf-checkpoint. Said in one line; the maker's own refusal is the run's one line."""
    from vime.errors import UserError
    from vime.models.config_checks import fresh_mtp_layers
    from vime.models.hf_format import read_config

    count, m, r = fresh_mtp_layers(cfg.mtp, read_config(cfg.model.hf_checkpoint)), cfg.mtp, cfg.rollout
    if not count:
        return
    out = os.path.join(cfg.run.output_dir, "fresh_mtp_checkpoint")
    print(f"[vime] {cfg.model.hf_checkpoint} has no MTP layers: adding {count} fresh one(s), initialised as "
          f"megatron-core initialises them, warmed up for up to {m.warmup_steps} steps on its own responses to "
          f"{r.prompt_data} -> {out}", flush=True)
    cmd = [sys.executable, os.path.join(REPO_ROOT, "scripts", "make_mtp_draft.py"), "--target", cfg.model.hf_checkpoint,
           "--out", out, "--mtp-num-layers", str(count), "--warmup-steps", str(m.warmup_steps),
           "--warmup-samples", str(m.warmup_samples), "--batch-size", str(m.warmup_batch_size),
           "--prompt-data", r.prompt_data, "--input-key", r.input_key, "--label-key", r.label_key,
           "--max-new-tokens", str(r.rollout_max_response_len), "--seed", str(r.rollout_seed)]
    proc = subprocess.run(cmd + (["--apply-chat-template"] if r.apply_chat_template else []), stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")] or proc.stderr.splitlines()
        raise UserError(f"adding fresh MTP layers: {(lines or ['the maker failed'])[-1].removeprefix('error: ')}")
    cfg.model.hf_checkpoint = out
