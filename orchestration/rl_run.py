"""One RL run's actors and its per-step stages (generate, train, push weights, save), and the
one-line messages for an actor lost mid-run. train_rl.py's loop calls one method per stage."""
import os
import pickle

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

    def evaluate(self, step):
        """eval/* metrics of the held-out prompts at this step's weights ({} when none are due)."""
        return ray_get(self.rollout.evaluate.remote(step)) if self.rollout else {}

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


class ActorLost(RuntimeError):
    """An actor of the run died; the message names it and how to resume."""
