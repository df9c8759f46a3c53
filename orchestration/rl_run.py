"""One RL run's actors and its per-step stages (generate, train, push weights, save), and the
one-line messages for an actor lost mid-run. train_rl.py's loop calls one method per stage."""
import os
import pickle
import time

from vime.errors import UserError


class RLRun:
    """The actors of one run and the per-step stages. A stage that loses rollout engines replaces them
    and goes on (`heal`, orchestration/healing.py); `teardown` ends every actor of the run, for a
    trainer restart (train_rl.py)."""

    def __init__(self, cfg):
        from rollout.health import EngineWatch
        from rollout.ray_workers import RolloutManager
        from vime import checkpointing
        from orchestration.driver import PushAborts, TrainerGroup, check_transport_fits
        from orchestration.healing import RestartBudget
        from orchestration.placement import Placement

        self.cfg = cfg
        self.start_step, self.loop_state, model_load = 0, {}, None
        if cfg.run.load:  # the iteration train_rl.prepare chose and verified
            self.loop_state = checkpointing.load_loop_state(cfg.run.load)
            model_load = os.path.join(cfg.run.load, "model")
            self.start_step = self.loop_state["step"]
        check_transport_fits(cfg.rollout.vllm_weight_transfer)
        self.placement = Placement(cfg)  # checked against the cluster first: one line if it cannot fit
        engines = [self.placement.engine_options(i) for i in range(self.placement.demand.engines)]
        self.rollout = None if cfg.run.debug_train_only else RolloutManager.options(num_cpus=0).remote(
            cfg.rollout, cfg.model.hf_checkpoint, cfg.train.advantage_estimator, worker_options=engines,
            bf16=cfg.model.bf16, worker_cpus=self.placement.engine_cpus(),
            worker_gpu_shares=self.placement.engine_gpu_shares())
        self.trainers = None if cfg.run.debug_rollout_only else TrainerGroup(cfg, load=model_load,
                                                                             placement=self.placement)
        self.sync, self.aborts = None, None
        self.workers = ray_get(self.rollout.get_workers.remote()) if self.rollout else []
        self.actor_names = _actor_names(self.rollout, self.workers, self.trainers)
        self.actor_node_ids = {}
        self._name_nodes([(w, "engine", i) for i, w in enumerate(self.workers)] +
                         [(a, "rank", r) for r, a in enumerate(self.trainers.actors if self.trainers else [])])
        if self.rollout:  # started: step 0 times no actor start-up
            ray_get(self.rollout.started.remote())
        self.watch = EngineWatch(cfg.rollout.rollout_health_timeout)
        self.engine_restarts = RestartBudget(cfg.rollout.max_engine_restarts, cfg.rollout.engine_restart_window)
        self.step_restarts = 0  # engine restarts during the step in flight (its fault/engine_restarts)
        if self.rollout and self.trainers:
            self.aborts = PushAborts.remote()
            self._connect_weight_sync()
        if self.loop_state and self.rollout:
            ray_get(self.rollout.set_data_cursor.remote(self.loop_state["data_cursor"]))
        self.weights_version = self.start_step  # the version the workers hold (after the first push)
        self.ahead = None  # --async-rollout: (step, its rollout in flight, weight version it runs on, data cursor before it)

    def _connect_weight_sync(self):
        from orchestration.driver import WeightSync

        r = self.cfg.rollout
        self.sync = WeightSync(self.trainers, self.workers, self.cfg.run, sync_draft=r.sync_draft_weights,
                               transport=r.vllm_weight_transfer, watch=self.watch, aborts=self.aborts)

    def generate(self, step):
        if self.rollout is None:
            with open(os.path.join(self.cfg.run.load_debug_rollout_data, f"step_{step:07d}.pkl"), "rb") as f:
                return pickle.load(f), {}
        samples, metrics, expected = self._healing(lambda: self._rollout(step), step)
        if self.sync:  # workers held the weights pushed after step - 1 (step - 2 when run ahead)
            check_weight_versions(samples, expected=expected)
            metrics.update(staleness_metrics(samples, step))
        if self.trainers and not self.cfg.run.async_rollout:  # the trainer's turn: engines let go of memory
            metrics.update(self._healing(lambda: ray_get(self.rollout.release_memory.remote()), step))
        if self.cfg.run.save_debug_rollout_data:
            os.makedirs(self.cfg.run.save_debug_rollout_data, exist_ok=True)
            with open(os.path.join(self.cfg.run.save_debug_rollout_data, f"step_{step:07d}.pkl"), "wb") as f:
                pickle.dump(samples, f)
        return samples, metrics

    def _rollout(self, step):
        """(samples, metrics, the weight version they were generated with) of `step`: the rollout started
        ahead (--async-rollout) when there is one, else one started now."""
        if self.ahead and self.ahead[0] == step:  # started during the previous step's training
            _, pending, expected, _ = self.ahead
            self.ahead = None
            samples, metrics = ray_get(pending)
            return samples, metrics, expected
        samples, metrics = ray_get(self.rollout.generate.remote(step, self.weights_version))
        return samples, metrics, self.weights_version

    def evaluate(self, step):
        """eval/* metrics of the held-out prompts at this step's weights ({} when none are due)."""
        return self._healing(lambda: ray_get(self.rollout.evaluate.remote(step)), step) if self.rollout else {}

    def train(self, samples):
        return self.trainers.train(samples) if self.trainers else {}

    def start_next_rollout(self, step):
        """--async-rollout: start the rollout of `step` now, on the weights (and draft) the workers
        hold, so it runs while the trainer trains on the previous step (no-op otherwise)."""
        if not (self.cfg.run.async_rollout and self.rollout and step < self.cfg.run.num_rollout):
            return
        cursor = ray_get(self.rollout.data_cursor.remote())  # a checkpoint of this step resumes before it
        self.ahead = (step, self.rollout.generate.remote(step, self.weights_version), self.weights_version, cursor)

    def push_weights(self, version, step=None):
        """Push the trainer's weights as `version` after `step` (the first push: before step `version`)."""
        if self.ahead:  # the workers load the new weights only after the rollout running ahead is done
            import ray

            ray.wait([self.ahead[1]])
        self.weights_version = version
        if not self.sync:
            return {}
        return self._healing(lambda: self.sync.push(version), version if step is None else step, pushes=True)

    def fault_metrics(self):
        """This step's fault/* counts (and a fresh count for the next step)."""
        restarts, self.step_restarts = self.step_restarts, 0
        return {"fault/engine_restarts": restarts} if self.rollout else {}

    def _healing(self, stage, step, pushes=False):
        """stage(), run again after the rollout engines it lost were replaced (`heal`); a stage that
        `pushes` the weights is done once the heal pushed them."""
        from orchestration.healing import engines_lost

        while True:
            try:
                return stage()
            except Exception as e:
                lost = engines_lost(e)
                if lost is None:
                    raise
                pushed = self.heal(lost, step)
                if pushes:
                    return pushed

    def heal(self, lost, step):
        """Replace the lost engines on their placements (each restart within the budget, else one line:
        ActorLost), then join every engine to a new push group and push the current weights, checked
        by the guard; returns that push's metrics ({} without trainers)."""
        from orchestration.healing import engine_budget_spent_line, engine_restart_line, engines_lost

        while True:
            current = {w._actor_id.hex() for w in self.workers}
            fresh = [(i, why) for i, actor_id, why in lost.lost if actor_id in current]  # not replaced already
            for i, why in fresh:
                name = self.actor_names[self.workers[i]._actor_id.hex()]
                if not self.engine_restarts.take():
                    raise ActorLost(engine_budget_spent_line(name, why, step, self.engine_restarts,
                                                             resume_hint(self.cfg.run)))
                self.step_restarts += 1
                print(engine_restart_line(name, why, step, self.engine_restarts), flush=True)
            try:
                if fresh:
                    self._replace_workers([i for i, _ in fresh])
                if not self.trainers:
                    return {}
                self._connect_weight_sync()
                return self.sync.push(self.weights_version)
            except Exception as e:
                lost = engines_lost(e)
                if lost is None:
                    raise

    def _replace_workers(self, indices):
        self.workers = ray_get(self.rollout.replace_workers.remote(indices))
        for i in indices:
            self.actor_names[self.workers[i]._actor_id.hex()] = f"rollout worker {i}"
        self._name_nodes([(self.workers[i], "engine", i) for i in indices])

    def trainer_lost(self, error):
        """The names of the trainer ranks that died when `error` ended a stage, else []: a dead rank's
        own error, or a collective broken by it (then the ranks are asked)."""
        from ray.exceptions import RayError

        if not self.trainers or not isinstance(error, RayError):
            return []
        ranks = {a._actor_id.hex(): r for r, a in enumerate(self.trainers.actors)}
        died = dead_actor(error)
        if died is not None and died.actor_id in ranks:
            dead = [ranks[died.actor_id]]
        else:
            dead = self.trainers.dead_ranks()
        return [self.actor_names[self.trainers.actors[r]._actor_id.hex()].split(" on ")[0] for r in dead]

    def teardown(self):
        """End every actor of the run and give its placement back (a trainer restart starts them anew);
        vLLM's engine processes are closed first where their workers still live."""
        import ray

        try:
            self.close()
        except Exception:  # noqa: BLE001 (the actors are killed below either way)
            pass
        for actor in [self.rollout, self.aborts, *self.workers, *(self.trainers.actors if self.trainers else [])]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self.placement.release()

    def _name_nodes(self, placed):
        """Add each actor's node (from its placement bundle) to its name, for the one-line fault messages;
        `placed`: [(actor, "engine" or "rank", index)]."""
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
        if set(self.actor_node_ids.values()) <= {ray.get_runtime_context().get_node_id()}:
            return None  # every actor of the run is on the driver's own node, which is here
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

    def close_after_error(self):
        """`close` when the run already ends on an error: that error is the one reported."""
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def save(self, step, stopping=False, wandb_run_id=None):
        """Save after `step` when --save is set and the interval is due, the step is the run's last,
        or the run is `stopping` (a signal): the last step done is never lost. The loop state holds the
        data cursor and the wandb run's id (a resumed run continues that run). Returns the saved step or None."""
        from vime import checkpointing

        run = self.cfg.run
        due = run.save_interval and (step + 1) % run.save_interval == 0
        if not (run.save and self.trainers and (due or stopping or step + 1 == run.num_rollout)):
            return None
        # with --async-rollout the next step's prompts are already drawn: save the cursor from before them
        cursor = self.ahead[3] if self.ahead else ray_get(self.rollout.data_cursor.remote()) if self.rollout else 0
        state = {"step": step + 1, "data_cursor": cursor, **({"wandb_run_id": wandb_run_id} if wandb_run_id else {})}
        try:
            checkpointing.save(run.save, step + 1, self.trainers.save, state, keep=run.save_keep)
        except checkpointing.CheckpointSaveError as e:
            if self.trainer_lost(e.original):  # a rank died while it wrote: the run restarts, the disk is fine
                raise e.original from None
            raise
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


def trainer_lost_message(names, run_cfg, step, restarts):
    """One line: which trainer ranks died, why the run cannot restart them itself, and how to resume."""
    if not run_cfg.save:
        why = "the run restarts its trainers by itself only from a checkpoint in --save"
    else:
        why = (f"the trainers were restarted {restarts} times already "
               f"(--max-trainer-restarts {run_cfg.max_trainer_restarts})")
    return (f"the {' and '.join(names)} died at step {step} (its process exited or was killed, e.g. out of memory), "
            f"and {why}; " + resume_hint(run_cfg))


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
