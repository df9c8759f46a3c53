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

from orchestration.rl_run import ActorLost, RLRun, dead_actor, lost_actor_message
from orchestration.stop_signals import Interrupted, StopRequest, StoppedBySignal, stop_message
from vime.errors import UserError


def run_loop(cfg, stop=None):
    """The run's steps; a stop signal (see `stop`) ends it at the next step's end with StoppedBySignal."""
    from contextlib import closing

    from tqdm import tqdm

    from vime.cli_config import describe
    from vime.run_logger import RunLogger

    stop = stop or StopRequest()
    with closing(RLRun(cfg)) as run:
        logger = RunLogger(cfg.run, {"config": describe(cfg)}, resume_step=run.start_step)
        try:
            saved = _steps(run, logger, cfg, tqdm, stop)
        except BaseException as e:
            logger.close(exit_code=1)  # wandb's closing lines now, so that the run's one error line comes last
            reported = _one_line_error(e, run, cfg, logger.next_step)
            if reported is None:
                raise
            raise reported from None
        logger.finish()
    if stop.name:
        raise StoppedBySignal(stop_message(f"stopped by {stop.name}", logger.next_step, cfg.run.save, saved),
                              stop.signum)
    return logger.history


def _one_line_error(error, run, cfg, step):
    """What ends the run mid-step as one line (Ctrl-C, a lost node, a dead actor), or None for any other error."""
    if isinstance(error, KeyboardInterrupt):
        return Interrupted(stop_message("interrupted (Ctrl-C)", step, cfg.run.save))
    if not isinstance(error, Exception):
        return None
    lost = run.lost_node_message(error, step)
    if lost:
        return ActorLost(lost)
    died = dead_actor(error)
    return None if died is None else ActorLost(lost_actor_message(died, run.actor_names, cfg.run, step))


def _steps(run, logger, cfg, tqdm, stop):
    """Each step, then its checkpoint; returns the step saved when a stop signal ended the loop."""
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
        sync_metrics = run.push_weights(version=step + 1)
        metrics = {**rollout_metrics, **train_metrics, **sync_metrics, "perf/step_time": time.perf_counter() - start,
                   **eval_metrics}
        logger.log(step, metrics)
        steps.set_postfix(reward=f"{metrics.get('rollout/reward', 0):.3f}",
                          accept_len=f"{metrics.get('rollout/spec_accept_length', 0):.2f}")
        saved = run.save(step, stopping=stop.name is not None)
        if stop.name:  # the safe point: this step is done, logged and saved
            return saved
    return None


def prepare(cfg):
    """Everything before Ray starts, in order: the checks (orchestration/preflight.py, which change
    nothing) and, between them, the named steps that change the config or the disk
    (orchestration/run_setup.py). A bad input stops it with one UserError line. Returns the locks
    of the run's directories, held until their `release()`."""
    from orchestration.preflight import check_config, check_inputs, check_prompts, check_resume
    from orchestration.run_setup import (add_fresh_mtp_layers, choose_checkpoint, lock_run_dirs,
                                         make_tiny_model_if_missing, resolve_paths, write_variant_prompts)

    check_config(cfg)  # reads no file: a typo stops the run before a 25-minute pretraining
    resolve_paths(cfg)
    make_tiny_model_if_missing(cfg.model)
    hf = check_inputs(cfg)  # the checkpoint, the draft, the backend, the output directories
    if cfg.run.load:
        choose_checkpoint(cfg.run)  # the newest valid checkpoint under --load, every file verified
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
