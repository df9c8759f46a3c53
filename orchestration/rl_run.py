"""One RL run's actors and its per-step stages (generate, train, push weights, save), and the
one-line messages for an actor lost mid-run. train_rl.py's loop calls one method per stage."""
import os
import pickle
import time

from vime.errors import UserError

class RLRun:
    """The actors of one run and the per-step stages."""

    def __init__(self, cfg):
        from rollout.ray_workers import RolloutManager
        from vime import checkpointing
        from orchestration.driver import TrainerGroup, WeightSync, check_transport_fits
        from orchestration.placement import Placement

        self.cfg = cfg
        self.start_step, state, model_load = 0, None, None
        if cfg.run.load:  # the iteration train_rl.prepare chose and verified
            state, model_load = checkpointing.load_loop_state(cfg.run.load), os.path.join(cfg.run.load, "model")
            self.start_step = state["step"]
        check_transport_fits(cfg.rollout.vllm_weight_transfer)
        self.placement = Placement(cfg)  # checked against the cluster first: one line if it cannot fit
        engines = [self.placement.engine_options(i) for i in range(self.placement.demand.engines)]
        self.rollout = None if cfg.run.debug_train_only else RolloutManager.options(num_cpus=0).remote(
            cfg.rollout, cfg.model.hf_checkpoint, cfg.train.advantage_estimator, worker_options=engines,
            bf16=cfg.model.bf16, worker_cpus=self.placement.engine_cpus(),
            worker_gpu_shares=self.placement.engine_gpu_shares())
        self.trainers = None if cfg.run.debug_rollout_only else TrainerGroup(cfg, load=model_load,
                                                                             placement=self.placement)
        self.sync = None
        workers = ray_get(self.rollout.get_workers.remote()) if self.rollout else []
        self.actor_names = _actor_names(self.rollout, workers, self.trainers)
        self._name_nodes(workers)
        ray_get([w.weight_version.remote() for w in workers])  # started: step 0 times no actor start-up
        if self.rollout and self.trainers:
            self.sync = WeightSync(self.trainers, workers, cfg.run, sync_draft=cfg.rollout.sync_draft_weights,
                                   transport=cfg.rollout.vllm_weight_transfer)
        if state and self.rollout:
            ray_get(self.rollout.set_data_cursor.remote(state["data_cursor"]))
        self.weights_version = self.start_step  # the version the workers hold (after the first push)
        self.ahead = None  # --async-rollout: (step, its rollout in flight, weight version it runs on, data cursor before it)

    def generate(self, step):
        if self.rollout is None:
            with open(os.path.join(self.cfg.run.load_debug_rollout_data, f"step_{step:07d}.pkl"), "rb") as f:
                return pickle.load(f), {}
        if self.ahead and self.ahead[0] == step:  # started during the previous step's training
            _, pending, expected, _ = self.ahead
            samples, metrics = ray_get(pending)
            self.ahead = None
        else:
            samples, metrics = ray_get(self.rollout.generate.remote(step))
            expected = self.weights_version
        if self.sync:  # workers held the weights pushed after step - 1 (step - 2 when run ahead)
            check_weight_versions(samples, expected=expected)
            metrics.update(staleness_metrics(samples, step))
        if self.trainers and not self.cfg.run.async_rollout:  # the trainer's turn: engines let go of memory
            metrics.update(ray_get(self.rollout.release_memory.remote()))
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

    def start_next_rollout(self, step):
        """--async-rollout: start the rollout of `step` now, on the weights (and draft) the workers
        hold, so it runs while the trainer trains on the previous step (no-op otherwise)."""
        if not (self.cfg.run.async_rollout and self.rollout and step < self.cfg.run.num_rollout):
            return
        cursor = ray_get(self.rollout.data_cursor.remote())  # a checkpoint of this step resumes before it
        self.ahead = (step, self.rollout.generate.remote(step), self.weights_version, cursor)

    def push_weights(self, version):
        if self.ahead:  # the workers load the new weights only after the rollout running ahead is done
            import ray

            ray.wait([self.ahead[1]])
        self.weights_version = version
        return self.sync.push(version) if self.sync else {}

    def _name_nodes(self, workers):
        """Add each actor's node (from its placement bundle) to its name, for the one-line fault messages."""
        placed = [(w, "engine", i) for i, w in enumerate(workers)]
        placed += [(a, "rank", r) for r, a in enumerate(self.trainers.actors if self.trainers else [])]
        self.actor_node_ids = {}
        for actor, kind, index in placed:
            key = actor._actor_id.hex()
            self.actor_node_ids[key] = self.placement.node_id_of(kind, index)
            self.actor_names[key] += f" on {self.placement.node_of(kind, index)}"

    def lost_node_message(self, error, step):
        """One line when `error` comes from a node of the run that is gone (its actors died with it, or a
        peer's collective broke), naming the node and the checkpoint to resume from; else None.
        An actor killed with its node can be reported dead before the GCS has marked the node dead
        (its health checks must fail first), and a broken connection to a peer can come first too:
        then the GCS is given the while it takes to notice."""
        import ray
        from ray.exceptions import RayError

        if not isinstance(error, RayError) or isinstance(getattr(error, "cause", None), UserError):
            return None
        text = str(error)
        broken_peer = any(word in text for word in ("onnection", "peer", "loo"))  # gloo: "Connection closed by peer"
        detect_s = node_death_detection_s()
        wait_s = max(30, detect_s) if broken_peer else detect_s if dead_actor(error) else 0
        ours = set(self.actor_node_ids.values())
        deadline = time.time() + wait_s
        while True:
            gone = [n["NodeID"] for n in ray.nodes() if n["NodeID"] in ours and not n["Alive"]]
            if gone or time.time() > deadline:
                break
            time.sleep(1)
        if not gone:
            return None
        from orchestration.placement import describe_node

        node = describe_node(gone[0], ray.nodes())
        held = [self.actor_names[a].split(" on ")[0] for a, n in self.actor_node_ids.items() if n == gone[0]]
        return f"{node} was lost at step {step}, with the {', '.join(held)} on it; " + resume_hint(self.cfg.run)

    def close(self):
        """Stop the processes a rollout backend started (vLLM's engine) before Ray goes down."""
        if not self.rollout:
            return
        try:
            ray_get(self.rollout.close_workers.remote())
        except Exception as e:  # a dead actor took its processes with it; the run's own error is reported
            if dead_actor(e) is None:
                raise

    def save(self, step, stopping=False):
        """Save after `step` when --save is set and the interval is due, the step is the run's last,
        or the run is `stopping` (a signal): the last step done is never lost. Returns the saved step or None."""
        from vime import checkpointing

        run = self.cfg.run
        due = run.save_interval and (step + 1) % run.save_interval == 0
        if not (run.save and self.trainers and (due or stopping or step + 1 == run.num_rollout)):
            return None
        # with --async-rollout the next step's prompts are already drawn: save the cursor from before them
        cursor = self.ahead[3] if self.ahead else ray_get(self.rollout.data_cursor.remote()) if self.rollout else 0
        checkpointing.save(run.save, step + 1, self.trainers.save, {"step": step + 1, "data_cursor": cursor},
                           keep=run.save_keep)
        return step + 1


def check_weight_versions(samples, expected):
    """Every sample was generated with the weights of version `expected` (else the sync lags)."""
    from orchestration.driver import WeightSyncError

    stale = sorted({s.weight_version for s in samples} - {expected})
    if stale:
        raise WeightSyncError(f"step {expected}: samples were generated with weight version(s) {stale}, "
                              f"but the trainer pushed version {expected}; stopping (off-policy samples)")


def staleness_metrics(samples, step):
    """How many steps behind the trained policy the weights and the draft of a batch were
    (0 when synchronous; 1 under --async-rollout; the draft more under --no-sync-draft-weights)."""
    weights = [step - s.weight_version for s in samples]
    drafts = [step - s.draft_version for s in samples]
    return {"rollout/weight_staleness": sum(weights) / len(weights), "rollout/weight_staleness_max": max(weights),
            "rollout/draft_staleness": sum(drafts) / len(drafts), "rollout/draft_staleness_max": max(drafts)}


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


def node_death_detection_s():
    """Seconds the GCS takes to mark a node whose raylet is gone as dead: its health checks
    (one per period) must fail `threshold` times in a row; one period of margin."""
    from ray._raylet import Config

    return Config.health_check_period_ms() * (Config.health_check_failure_threshold() + 1) / 1000


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
    who = names.get(died.actor_id or "", "a Ray actor")
    if who == "a Ray actor" and died.actor_id is None and "rollout" in str(died):
        who = "a rollout worker"
    return f"the {who} died at step {step} (its process exited or was killed, e.g. out of memory); " + \
        resume_hint(run_cfg)


def resume_hint(run_cfg):
    """'resume with --load DIR (last checkpoint: step N)', or how to be able to next time."""
    from vime.checkpointing import latest

    found = latest(run_cfg.save) if run_cfg.save and os.path.isdir(run_cfg.save) else None
    return (f"resume with --load {run_cfg.save} (last checkpoint: step {found[0]})" if found else
            "no checkpoint was saved yet: rerun, with --save DIR --save-interval K to be able to resume")


def ray_get(ref):
    import ray

    return ray.get(ref)


class ActorLost(RuntimeError):
    """An actor of the run died; the message names it and how to resume."""
