#!/usr/bin/env python
"""vime: RL post-training with MTP-speculative rollouts and an online-trained draft.

    python train_rl.py --enable-mtp-training --mtp-num-layers 1 \
        --vllm-speculative-config '{"method":"mtp","num_speculative_tokens":2}' [hydra.key=value ...]

Each step: generate (speculative) -> rewards/advantages -> train policy (+ MTP) -> push the
weights, MTP layers included, to every rollout worker and verify them -> log -> save.
`python train_rl.py --help` lists every flag and the config field it sets.
"""
import sys
import time

from orchestration.rl_run import ActorLost, RLRun, dead_actor, lost_actor_message, trainer_lost_message
from orchestration.stop_signals import Interrupted, StopRequest, StoppedBySignal, stop_message
from vime.errors import UserError


def run_loop(cfg, stop=None):
    """The run's steps; a stop signal (see `stop`) ends it at the next step's end with StoppedBySignal.
    A trainer rank lost mid-run restarts the run's actors from the newest valid checkpoint in --save
    (`_restart_point`), in this process, up to --max-trainer-restarts times; the logger carries on."""
    from tqdm import tqdm

    from vime.cli_config import describe
    from vime.run_logger import RunLogger

    stop = stop or StopRequest()
    logger, restarts = None, 0
    while True:
        try:
            run = RLRun(cfg)
        except BaseException:
            if logger is not None:
                logger.close(exit_code=1)
            raise
        try:
            if logger is None:
                logger = RunLogger(cfg.run, {"config": describe(cfg)}, resume_step=run.start_step,
                                   resume_id=run.loop_state.get("wandb_run_id"))
            else:
                logger.rewind(run.start_step)
            saved = _steps(run, logger, cfg, tqdm, stop, restarted=restarts > 0)
        except BaseException as e:
            step = logger.next_step if logger else run.start_step
            node_lost = run.lost_node_message(e, step) if isinstance(e, Exception) else None
            lost = run.trainer_lost(e) if isinstance(e, Exception) and not node_lost else []
            if lost and cfg.run.save and restarts < cfg.run.max_trainer_restarts:
                restarts += 1
                _restart_point(cfg.run, lost, step, restarts)
                run.teardown()
                continue
            if logger is not None:
                logger.close(exit_code=1)  # wandb's closing lines now, so that the run's one error line comes last
            reported = _one_line_error(e, run, cfg, step, node_lost, lost, restarts)
            run.close_after_error()
            if reported is None:
                raise
            raise reported from None
        run.close()
        logger.finish()
        break
    if stop.name:
        raise StoppedBySignal(stop_message(f"stopped by {stop.name}", logger.next_step, cfg.run.save, saved),
                              stop.signum, requeue=saved is not None)
    return logger.history


def _restart_point(run_cfg, lost, step, restart):
    """Point --load at the newest valid checkpoint in --save (none yet: the start) and say so in one line."""
    from orchestration.healing import trainer_restart_line
    from vime.checkpointing import checkpoint_steps, resolve_load

    resumed = None
    if checkpoint_steps(run_cfg.save):
        resumed, run_cfg.load, _ = resolve_load(run_cfg.save, flag="--save")
    else:
        run_cfg.load = None
    print(trainer_restart_line(lost, step, resumed, restart, run_cfg.max_trainer_restarts), flush=True)


def _one_line_error(error, run, cfg, step, node_lost=None, trainer_lost=(), restarts=0):
    """What ends the run mid-step as one line (Ctrl-C, a lost node, a dead actor, engines lost more often
    than allowed), or None for any other error."""
    if isinstance(error, KeyboardInterrupt):
        return Interrupted(stop_message("interrupted (Ctrl-C)", step, cfg.run.save))
    if not isinstance(error, Exception):
        return None
    if isinstance(error, ActorLost):
        return error
    if node_lost:
        return ActorLost(node_lost)
    if trainer_lost:
        return ActorLost(trainer_lost_message(trainer_lost, cfg.run, step, restarts))
    died = dead_actor(error)
    return None if died is None else ActorLost(lost_actor_message(died, run.actor_names, cfg.run, step))


def _steps(run, logger, cfg, tqdm, stop, restarted=False):
    """Each step, then its checkpoint; returns the step saved when a stop signal ended the loop.
    `restarted`: the trainers were just restarted (counted in the first step's fault/trainer_restarts)."""
    run.push_weights(version=run.start_step)  # workers start from the trainer's (maybe resumed) weights
    if stop.name:
        return None
    steps = tqdm(range(run.start_step, cfg.run.num_rollout), desc="RL steps", disable=not cfg.run.progress)
    for step in steps:
        start = time.perf_counter()
        eval_metrics = run.evaluate(step)  # the weights this step's rollout uses (pushed after step - 1)
        samples, rollout_metrics = run.generate(step)
        run.start_next_rollout(step + 1)  # --async-rollout: step + 1 generates while this step trains
        train_metrics = run.train(samples)
        sync_metrics = run.push_weights(version=step + 1, step=step)
        metrics = {**rollout_metrics, **train_metrics, **sync_metrics, "perf/step_time": time.perf_counter() - start,
                   **eval_metrics, **run.fault_metrics(), "fault/trainer_restarts": int(restarted)}
        restarted = False
        logger.log(step, metrics)
        steps.set_postfix(reward=f"{metrics.get('rollout/reward', 0):.3f}",
                          accept_len=f"{metrics.get('rollout/spec_accept_length', 0):.2f}")
        saved = run.save(step, stopping=stop.name is not None, wandb_run_id=logger.run_id)
        if stop.name:  # the safe point: this step is done, logged and saved
            return saved
    return None


def prepare(cfg):
    """Everything before Ray starts, in order: the checks (orchestration/preflight.py, which change
    nothing) and, between them, the named steps that change the config or the disk
    (orchestration/run_setup.py). A bad input stops it with one UserError line. Returns the locks
    of the run's directories, held until their `release()`."""
    from orchestration.preflight import check_config, check_inputs, check_prompts, check_resume
    from orchestration.run_setup import (add_fresh_mtp_layers, choose_checkpoint, load_from_save_by_default,
                                         lock_run_dirs, make_tiny_model_if_missing, resolve_paths,
                                         write_variant_prompts)

    check_config(cfg)  # reads no file: a typo stops the run before a 25-minute pretraining
    resolve_paths(cfg)
    make_tiny_model_if_missing(cfg.model)
    hf = check_inputs(cfg)  # the checkpoint, the draft, the backend, the output directories
    by_default = load_from_save_by_default(cfg.run)  # a requeued job's same command resumes
    if cfg.run.load:
        choose_checkpoint(cfg.run, by_default)  # the newest valid checkpoint under --load, every file verified
        check_resume(cfg, hf)  # its step, its flags and its tensors against this run's
    locks = lock_run_dirs(cfg)  # before anything is written there; a second run on them stops here
    try:
        write_variant_prompts(cfg)  # into --output-dir, checked writable and locked just above
        check_prompts(cfg, hf)
        add_fresh_mtp_layers(cfg)  # on a checkpoint without MTP layers: the run's own, made there
    except BaseException:
        locks.release()
        raise
    return locks


def main(argv=None):
    from vime.checkpointing import CheckpointSaveError
    from vime.cli_config import help_text, load_config
    from orchestration.driver import WeightSyncError, init_ray
    from orchestration.placement import needed_cpus
    from orchestration.run_tmp import RunTempDir

    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    locks = run_tmp = None
    stop = StopRequest()
    try:
        stop.install()
        cfg = load_config(argv)
        locks = prepare(cfg)  # --output-dir and --save locked: a second run on either is refused
        run_tmp = RunTempDir()  # before Ray starts: the actors inherit TMPDIR through the raylet
        init_ray(cfg.run, needed_cpus(cfg))
        stop.install()  # over Ray's own SIGTERM handlers
        run_loop(cfg, stop)
    except UserError as e:  # raised in an actor it arrives wrapped by Ray: report the cause's line
        print(f"error: {str(getattr(e, 'cause', None) or e).splitlines()[0]}", file=sys.stderr)
        return 2
    except (WeightSyncError, ActorLost, CheckpointSaveError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except StoppedBySignal as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except Interrupted as e:
        print(f"error: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # one line, not Python's and Ray's tracebacks
        print("error: interrupted (Ctrl-C) before the first step; nothing was trained", file=sys.stderr)
        return 130
    finally:
        _shutdown_ray()
        stop.restore()
        if run_tmp:
            run_tmp.remove()
        if locks:
            locks.release()
    return 0


def _shutdown_ray():
    import ray

    if ray.is_initialized():
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
