"""Driver-side handles of the Ray actors: the trainer group, the rollout side, the weight sync.

train_rl.py's loop calls one method of these per stage; everything here runs in the driver.
"""
import logging
import os

import ray

from orchestration.stop_signals import stop_signals_blocked_in_children
from vime import weight_sync
from vime.errors import require


class WeightSyncError(RuntimeError):
    """A rollout worker's weights differ from the trainer's after a sync."""


class TrainerGroup:
    """TP x PP x DP TrainerActors joined by torch.distributed."""

    def __init__(self, cfg, load=None, placement=None):
        from trainer.config import TrainerConfig
        from trainer.ray_actor import TrainerActor

        t = cfg.train
        self.layout = t.layout
        self.world = t.world_size
        self.dp = t.data_parallel_size
        self.steps_per_rollout = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt // t.global_batch_size
        gpus = ray.cluster_resources().get("GPU", 0)
        opts = {"num_gpus": 1} if gpus else {"num_cpus": 1}
        tcfg = TrainerConfig.from_tree(cfg)
        threads = placement.trainer_threads() if placement else 1
        self.actors = [TrainerActor.options(**(placement.trainer_options(rank) if placement else opts)).remote(
            rank, self.world, tcfg, cfg.model.hf_checkpoint, load, threads=threads) for rank in range(self.world)]
        # rank 0 hosts the group: its node's IP, so ranks on other nodes can join
        master_addr, port = ray.get(self.actors[0].rendezvous.remote())
        ray.get([a.start.remote(master_addr, port) for a in self.actors])

    def train(self, samples):
        """Each DP rank trains on its share (every rank of its TP x PP grid on the same); returns rank 0's
        metrics (reduced over DP, from the last pipeline stage)."""
        shards = [samples[d::self.dp] for d in range(self.dp)]
        futures = [a.train.remote(shards[self.layout.dp_rank(rank)], self.steps_per_rollout)
                   for rank, a in enumerate(self.actors)]
        return get_all(futures)[0]

    def save(self, path):
        get_all([a.save.remote(path) for a in self.actors])

    def dead_ranks(self, wait_s=10.0):
        """The ranks whose actor is dead. A live rank may be busy (in a collective with a dead one, which
        holds it until gloo's timeout): only an answer that it died counts."""
        from ray.exceptions import RayActorError

        refs = [a.__ray_ready__.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        dead = []
        for rank, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except RayActorError:
                    dead.append(rank)
        return dead


def get_all(refs):
    """ray.get of every ref, raising the first error as soon as it comes (ray.get of a list would wait
    for a rank that is stuck in a collective with a dead one)."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done[0])  # raises a failed one's error now
    return ray.get(list(refs))


@ray.remote(num_cpus=0)
class PushAborts:
    """Which weight pushes the driver gave up (an engine of the push group was lost): the trainer and the
    engines ask while a broadcast waits, and stop waiting then (vime/weight_sync.py)."""

    def __init__(self):
        self.aborted = set()

    def abort(self, push_id):
        self.aborted.add(push_id)

    def is_aborted(self, push_id):
        return push_id in self.aborted


class PushAbort:
    """One push's `aborted()` as the trainer and the engines call it (picklable: Ray carries it to them)."""

    def __init__(self, aborts, push_id):
        self.aborts, self.push_id = aborts, push_id

    def __call__(self):
        return ray.get(self.aborts.is_aborted.remote(self.push_id))

    def abort(self):
        self.aborts.abort.remote(self.push_id)


def check_transport_fits(transport):
    """Before any actor starts: a GPU-only transport needs a cluster with GPUs."""
    from trainer.weight_senders import SENDERS

    require(not SENDERS[transport].needs_gpus or ray.cluster_resources().get("GPU", 0) > 0,
            f"--vllm-weight-transfer {transport} moves weights between GPUs and this Ray cluster has none; "
            "use --vllm-weight-transfer reload")


class WeightSync:
    """Trainer rank 0 -> every rollout worker, versioned and verified after each push.

    A transport is a sender on trainer rank 0 (trainer/weight_senders.py) and each engine's receiver
    (rollout/weight_receiver.py, given by its backend); this class only introduces them: the engines'
    plan to the sender, one rendezvous for all, the sender's header to the engines with each push.
    Engines on trainer rank 0's own device (vime/devices.py: a GPU they share, or on CPU a logical
    GPU Ray gave both) take the in-place hand-over, whatever --vllm-weight-transfer says (NCCL cannot
    join two processes on one GPU); the others take the run's transport."""

    def __init__(self, trainers, workers, run_cfg, sync_draft=True, transport="reload", watch=None, aborts=None):
        from orchestration.placement import WeightRoutes

        self.trainers, self.workers = trainers, workers
        self.watch, self.aborts = watch, aborts  # the engines' hang watch (rollout/health.py), PushAborts
        self.check_all = run_cfg.check_weight_update_equal
        self.sync_draft = sync_draft  # False: target-only sync, a stale draft is reported, not fatal
        self.warned_stale = False
        trainer_at = ray.get(trainers.actors[0].device_identity.remote())
        self.routes = WeightRoutes(trainer_at, ray.get([w.device_identity.remote() for w in workers]), transport)
        self.headers = {t: self._connect(t, engines, trainer_at["device"], run_cfg.update_weight_buffer_size)
                        for t, engines in self.routes.engines.items()}

    def _connect(self, transport, engines, device, buffer_size):
        """Engines `engines` take their receiver of `transport`; trainer rank 0 (the group's rank 0, on its
        node's address) and those engines (ranks 1..n) join at once; returns the sender's header of a push.
        The group moves tensors of trainer rank 0's own device (CUDA: NCCL, CPU: gloo)."""
        plans = ray.get([self.workers[i].weight_plan.remote(transport) for i in engines])
        master_addr, port = ray.get(self.trainers.actors[0].rendezvous.remote())
        rendezvous = {"master_addr": master_addr, "master_port": port, "world_size": 1 + len(engines),
                      "device": device}
        opened = [a.open_weight_sender.remote(transport, plans[0], rendezvous, buffer_size)  # the engines are alike
                  for a in self.trainers.actors]
        ray.get([self.workers[i].join_weight_sync.remote(rendezvous, rank + 1) for rank, i in enumerate(engines)])
        return ray.get(opened)[0]

    def push(self, version):
        """Send all weights, then prove every worker holds the trainer's (stop if not). Engines of a group
        receive while rank 0 broadcasts; engines handed over in place take the buckets once rank 0 has
        built them (the note of its send maps them), then rank 0 lets them go. The engines are watched
        (rollout/health.py): one lost mid-push aborts the others' broadcast and ends the push with
        EnginesLost (the group is then unusable: the driver builds a new WeightSync)."""
        import uuid

        aborted = PushAbort(self.aborts, uuid.uuid4().hex) if self.aborts is not None else None
        calls = {("trainer", rank): (None, a.send_weights.remote(aborted))
                 for rank, a in enumerate(self.trainers.actors)}
        calls.update({i: (self.workers[i],
                          self.workers[i].receive_weights.remote(self.headers[t], version, None, aborted))
                      for t, engines in self.routes.engines.items() if not self.routes.in_place(t) for i in engines})
        outcomes = self._wait(calls, aborted, version)
        trainer = outcomes[("trainer", 0)]
        in_place = {i: (self.workers[i], self.workers[i].receive_weights.remote(self.headers[t], version,
                                                                              trainer["notes"][t], aborted))
                    for t, engines in self.routes.engines.items() if self.routes.in_place(t) for i in engines}
        outcomes.update(self._wait(in_place, aborted, version))
        received = [outcomes[i] for i in range(len(self.workers))]
        if self.routes.IN_PLACE in self.routes.engines:
            ray.get(self.trainers.actors[0].weights_taken.remote())
        stale = self._check_fingerprints(version, trainer, received)
        if self.check_all:
            self._compare_every_tensor(version)
        seconds = max(r["seconds"] for r in received)
        return {"weight_sync/bytes": trainer["bytes"], "weight_sync/seconds": seconds,
                "weight_sync/bytes_per_s": trainer["bytes"] / max(seconds, 1e-9),
                "weight_sync/draft_checksum": trainer["draft_checksum"][0],
                "weight_sync/target_checksum": trainer["target_checksum"][0],
                "weight_sync/worker_draft_checksum": (received[0]["draft_checksum"] or [float("nan")])[0],
                "weight_sync/in_place_engines": len(self.routes.engines.get(self.routes.IN_PLACE, [])),
                "rollout/weight_version_synced": version, "weight_sync/draft_stale": int(stale)}

    def _wait(self, calls, aborted, version):
        """The outcomes of a push's calls; the first failure aborts the push for everyone still in it. A
        trainer's error is raised as it is (a dead rank: the driver restarts the trainers), then EnginesLost
        for lost engines, then any other error."""
        from rollout.health import EnginesLost, lost_reason

        if not calls:
            return {}
        if self.watch is None:
            return dict(zip(calls, ray.get([ref for _, ref in calls.values()])))
        outcomes = self.watch.wait(calls, on_failure=lambda *_: aborted.abort() if aborted else None)
        failed = {key: e for key, e in outcomes.items() if isinstance(e, BaseException)}
        broken = {key: e for key, e in failed.items() if isinstance(getattr(e, "cause", None), weight_sync.PushBroken)}
        for key, e in failed.items():  # a rank that died, or failed otherwise than by the push breaking
            if isinstance(key, tuple) and key not in broken:
                raise e
        lost = [(key, self.workers[key]._actor_id.hex(), lost_reason(e)) for key, e in sorted(
            (k, e) for k, e in failed.items() if not isinstance(k, tuple)) if lost_reason(e)]
        if failed and not lost:  # no call says an engine was lost: ask the engines, a broken push may hide one
            found = self.watch.probe({key: worker for key, (worker, _) in calls.items() if worker is not None})
            lost = [(key, self.workers[key]._actor_id.hex(), why) for key, why in sorted(found.items())]
        if lost:
            raise EnginesLost(version - 1, lost)
        if failed:
            raise next(iter(failed.values()))
        return outcomes

    def _check_fingerprints(self, version, trainer, received):
        """Stop on any difference, except a stale draft under target-only sync (returns True then)."""
        stale = False
        for i, got in enumerate(received):
            for part in ("draft", "target"):
                if got[f"{part}_checksum"] in (trainer[f"{part}_checksum"], None):  # None: holds no such part
                    continue
                if part == "draft" and not self.sync_draft:
                    stale = True
                    continue
                raise WeightSyncError(
                    f"weight sync v{version}: rollout worker {i}'s {part} weights differ from the trainer's "
                    f"(checksum {got[f'{part}_checksum']} vs {trainer[f'{part}_checksum']}); stopping")
        if stale and not self.warned_stale:
            self.warned_stale = True
            print(f"[vime] weight sync v{version}: the rollout draft is stale — "
                  "--no-sync-draft-weights syncs only the target", flush=True)
        return stale

    def _compare_every_tensor(self, version):
        """--check-weight-update-equal: every worker's tensors against trainer rank 0's, by digest; the workers
        are asked as a push's calls are (an engine lost here is EnginesLost, which the run heals)."""
        reference = ray.get([a.digests.remote() for a in self.trainers.actors])[0]
        held = self._wait({i: (w, w.digests.remote()) for i, w in enumerate(self.workers)}, None, version)
        for i, got in sorted(held.items()):
            bad = sorted(k for k in reference if got.get(k) != reference[k])
            if bad:
                raise WeightSyncError(f"--check-weight-update-equal: after sync v{version} rollout worker {i} differs "
                                      f"from the trainer in {len(bad)} tensors (first: {bad[0]}); stopping")


def vllm_logging_env(verbose):
    """vLLM's logging for the job's actors: a VLLM_LOGGING_LEVEL the user set wins; else INFO under
    --verbose; else nothing, and the vLLM backend keeps vLLM at WARNING without its known start-up
    notices (rollout/vllm/quiet.py; its INFO lines outnumber a run's own output a hundred to one)."""
    level = os.environ.get("VLLM_LOGGING_LEVEL") or ("INFO" if verbose else None)
    return {"VLLM_LOGGING_LEVEL": level} if level else {}


def init_ray(run_cfg, needed_cpus):
    """Join --ray-address once a Ray head answers there within --ray-connect-timeout (its own token
    auth applies; orchestration/ray_connect.py) or start a local cluster of the run's own (never
    another cluster on the machine), closed to strangers:
    Ray's token authentication stays on (a new local cluster writes its token under ~/.ray/ and
    refuses clients without it), and no dashboard or debugger listens (they would bind ports of
    their own). Ray's GCS, raylet and object servers bind every interface; the token guards them."""
    from vime.config import REPO_ROOT

    from orchestration.placement import code_runtime_env
    from orchestration.ray_connect import LOCAL, check_ray_address

    # Ray announces its token-auth default with a warning line at every local start; the auth stays
    # as Ray sets it, only the line goes (a run's error output is one line; RAY_AUTH_MODE=disabled is
    # announced below by vime itself)
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    # the job's workers need the auth mode the driver joins with (a cluster started with `ray start` and
    # RAY_AUTH_MODE=token refuses workers that do not say so); the code travels with the job (working_dir)
    passed = {k: os.environ[k] for k in ("RAY_AUTH_MODE",) if k in os.environ}
    env = {**code_runtime_env(REPO_ROOT), "env_vars": {
        **passed, "OMP_NUM_THREADS": "1",
        # read by vLLM in the rollout actor and the engine process it spawns
        **vllm_logging_env(run_cfg.verbose)}}
    if run_cfg.ray_address:
        check_ray_address(run_cfg.ray_address, run_cfg.ray_connect_timeout)
        # Ray's own handler would add its INFO lines (connecting, the dashboard's address, the upload) to
        # the run's error output, as configure_logging=False spares a local start: a refusal that
        # needs the cluster (a placement it cannot hold) stays one line; Ray's warnings still show
        ray.init(address=run_cfg.ray_address, runtime_env=env, log_to_driver=True, configure_logging=False)
    else:
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":  # unset: Ray turns token auth on
            print("[vime] RAY_AUTH_MODE=disabled: this Ray cluster accepts any client that reaches it", flush=True)
        with stop_signals_blocked_in_children():  # a signal to the whole job reaches only the driver
            # "local": a new instance of the run's own, never the cluster a `ray start` (running or ended)
            # named in Ray's temp dir (orchestration/ray_connect.py)
            ray.init(address=LOCAL, num_cpus=max(os.cpu_count() or 1, needed_cpus), include_dashboard=False,
                     runtime_env=env, log_to_driver=True, configure_logging=False)

