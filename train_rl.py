#!/usr/bin/env python
"""vime: RL post-training with MTP-speculative rollouts and an online-trained draft.

    python train_rl.py --enable-mtp-training --mtp-num-layers 1 \
        --vllm-speculative-config '{"method":"mtp","num_speculative_tokens":2}' [hydra.key=value ...]

Each step: generate (speculative) -> rewards/advantages -> train policy (+ MTP) -> push the
weights, MTP layers included, to every rollout worker and verify them -> log -> save.
`python train_rl.py --help` lists every flag and the config field it sets.
"""
import os
import pickle
import sys
import time

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
        read_prompt_file(cfg.rollout.prompt_data, cfg.rollout.input_key, cfg.rollout.label_key,
                         codec=_codec(cfg.model.hf_checkpoint))
        get_reward_fn(cfg.rollout.rm_type, cfg.rollout.custom_rm_path)
    if cfg.run.load:
        check_resume(cfg)


def _codec(hf_checkpoint):
    from rollout.tokenizer import TextCodec

    has = os.path.isfile(os.path.join(hf_checkpoint, "tokenizer.json"))
    require(has, f"--hf-checkpoint {hf_checkpoint}: tokenizer.json is missing; RL prompts are text")
    return TextCodec(hf_checkpoint)


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
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "make_tiny_model.py")
    subprocess.run([sys.executable, script, "--out", path], check=True)


class RLRun:
    """The actors of one run and the per-step stages."""

    def __init__(self, cfg):
        from rollout.ray_workers import RolloutManager
        from vime import checkpointing
        from orchestration.driver import TrainerGroup, WeightSync

        self.cfg = cfg
        self.start_step, state, model_load = 0, None, None
        if cfg.run.load:
            self.start_step, iteration = checkpointing.latest(cfg.run.load)
            state, model_load = checkpointing.load_loop_state(iteration), os.path.join(iteration, "model")
        self.rollout = None if cfg.run.debug_train_only else RolloutManager.options(num_cpus=0).remote(
            cfg.rollout, cfg.model.hf_checkpoint, cfg.train.advantage_estimator)
        self.trainers = None if cfg.run.debug_rollout_only else TrainerGroup(cfg, load=model_load)
        self.sync = None
        workers = ray_get(self.rollout.get_workers.remote()) if self.rollout else []
        self.actor_names = _actor_names(self.rollout, workers, self.trainers)
        ray_get([w.weight_version.remote() for w in workers])  # started: step 0 times no actor start-up
        if self.rollout and self.trainers:
            self.sync = WeightSync(self.trainers, workers, cfg.run, sync_draft=cfg.rollout.sync_draft_weights)
        if state and self.rollout:
            ray_get(self.rollout.set_data_cursor.remote(state["data_cursor"]))

    def generate(self, step):
        if self.rollout is None:
            with open(os.path.join(self.cfg.run.load_debug_rollout_data, f"step_{step:07d}.pkl"), "rb") as f:
                return pickle.load(f), {}
        samples, metrics = ray_get(self.rollout.generate.remote(step))
        if self.sync:  # workers hold the weights pushed after step - 1 (or the resumed ones)
            check_weight_versions(samples, expected=step)
        if self.cfg.run.save_debug_rollout_data:
            os.makedirs(self.cfg.run.save_debug_rollout_data, exist_ok=True)
            with open(os.path.join(self.cfg.run.save_debug_rollout_data, f"step_{step:07d}.pkl"), "wb") as f:
                pickle.dump(samples, f)
        return samples, metrics

    def train(self, samples):
        return self.trainers.train(samples) if self.trainers else {}

    def push_weights(self, version):
        return self.sync.push(version) if self.sync else {}

    def close(self):
        """Stop the processes a rollout backend started (vLLM's engine) before Ray goes down."""
        if not self.rollout:
            return
        try:
            ray_get(self.rollout.close_workers.remote())
        except Exception as e:  # a dead actor took its processes with it; the run's own error is reported
            if dead_actor(e) is None:
                raise

    def save(self, step):
        from vime import checkpointing

        run = self.cfg.run
        if not (run.save and run.save_interval and (step + 1) % run.save_interval == 0 and self.trainers):
            return
        cursor = ray_get(self.rollout.data_cursor.remote()) if self.rollout else 0
        checkpointing.save(run.save, step + 1, self.trainers.save, {"step": step + 1, "data_cursor": cursor})


def check_weight_versions(samples, expected):
    """Every sample was generated with the weights of version `expected` (else the sync lags)."""
    from orchestration.driver import WeightSyncError

    stale = sorted({s.weight_version for s in samples} - {expected})
    if stale:
        raise WeightSyncError(f"step {expected}: samples were generated with weight version(s) {stale}, "
                              f"but the trainer pushed version {expected}; stopping (off-policy samples)")


def _actor_names(rollout, workers, trainers):
    """{actor id hex: readable name} of every actor of the run (for one-line fault messages)."""
    names = {}
    if rollout is not None:
        names[rollout._actor_id.hex()] = "rollout manager"
    for i, w in enumerate(workers):
        names[w._actor_id.hex()] = f"rollout worker {i}"
    for rank, a in enumerate(trainers.actors if trainers else []):
        names[a._actor_id.hex()] = f"trainer rank {rank}"
    return names


def dead_actor(error):
    """The RayActorError inside `error` (itself, or a task error's cause), or None."""
    from ray.exceptions import RayActorError

    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, RayActorError):
            return error
        seen.add(id(error))
        error = getattr(error, "cause", None) or error.__cause__
    return None


def lost_actor_message(died, names, run_cfg, step):
    """One line: which actor died, at which step, and how to resume."""
    from vime.checkpointing import latest

    who = names.get(died.actor_id or "", "a Ray actor")
    if who == "a Ray actor" and died.actor_id is None and "rollout" in str(died):
        who = "a rollout worker"
    found = latest(run_cfg.save) if run_cfg.save and os.path.isdir(run_cfg.save) else None
    resume = (f"resume with --load {run_cfg.save} (last checkpoint: step {found[0]})" if found else
              "no checkpoint was saved yet: rerun, with --save DIR --save-interval K to be able to resume")
    return f"the {who} died at step {step} (its process exited or was killed, e.g. out of memory); {resume}"


def ray_get(ref):
    import ray

    return ray.get(ref)


def run_loop(cfg):
    from contextlib import closing

    from tqdm import tqdm

    from vime.cli_config import describe
    from vime.run_logger import RunLogger

    with closing(RLRun(cfg)) as run:
        logger = RunLogger(cfg.run, {"config": describe(cfg)}, resume_step=run.start_step)
        try:
            _steps(run, logger, cfg, tqdm)
        except Exception as e:
            died = dead_actor(e)
            if died is None:
                raise
            raise ActorLost(lost_actor_message(died, run.actor_names, cfg.run, logger.next_step)) from None
        logger.finish()
    return logger.history


class ActorLost(RuntimeError):
    """An actor of the run died; the message names it and how to resume."""


def _steps(run, logger, cfg, tqdm):
    run.push_weights(version=run.start_step)  # workers start from the trainer's (maybe resumed) weights
    steps = tqdm(range(run.start_step, cfg.run.num_rollout), desc="RL steps", disable=not cfg.run.progress)
    for step in steps:
        start = time.perf_counter()
        samples, rollout_metrics = run.generate(step)
        train_metrics = run.train(samples)
        sync_metrics = run.push_weights(version=step + 1)
        metrics = {**rollout_metrics, **train_metrics, **sync_metrics, "perf/step_time": time.perf_counter() - start}
        logger.log(step, metrics)
        steps.set_postfix(reward=f"{metrics.get('rollout/reward', 0):.3f}",
                          accept_len=f"{metrics.get('rollout/spec_accept_length', 0):.2f}")
        run.save(step)


def main(argv=None):
    from vime.checkpointing import CheckpointSaveError, SaveLock
    from vime.cli_config import help_text, load_config
    from orchestration.driver import WeightSyncError, init_ray

    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    lock = None
    try:
        cfg = load_config(argv)
        preflight(cfg)
        lock = SaveLock(cfg.run.save) if cfg.run.save else None  # refuse a second run on the same --save
        t = cfg.train
        init_ray(cfg.run, cfg.rollout.rollout_num_workers + t.tensor_model_parallel_size * t.data_parallel_size)
        run_loop(cfg)
    except UserError as e:  # raised in an actor it arrives wrapped by Ray: report the cause's line
        print(f"error: {str(getattr(e, 'cause', None) or e).splitlines()[0]}", file=sys.stderr)
        return 2
    except (WeightSyncError, ActorLost, CheckpointSaveError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # one line, not Python's and Ray's tracebacks
        print("error: interrupted (Ctrl-C); resume from the last checkpoint with --load", file=sys.stderr)
        return 130
    finally:
        _shutdown_ray()
        if lock:
            lock.release()
    return 0


def _shutdown_ray():
    import ray

    if ray.is_initialized():
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
