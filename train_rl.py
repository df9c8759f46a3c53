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

from orchestration.preflight import preflight
from orchestration.rl_run import ActorLost, RLRun, dead_actor, lost_actor_message
from vime.errors import UserError


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


def _steps(run, logger, cfg, tqdm):
    run.push_weights(version=run.start_step)  # workers start from the trainer's (maybe resumed) weights
    steps = tqdm(range(run.start_step, cfg.run.num_rollout), desc="RL steps", disable=not cfg.run.progress)
    for step in steps:
        start = time.perf_counter()
        eval_metrics = run.evaluate(step)  # the weights this step's rollout uses (pushed after step - 1)
        samples, rollout_metrics = run.generate(step)
        train_metrics = run.train(samples)
        sync_metrics = run.push_weights(version=step + 1)
        metrics = {**rollout_metrics, **train_metrics, **sync_metrics, "perf/step_time": time.perf_counter() - start,
                   **eval_metrics}
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
