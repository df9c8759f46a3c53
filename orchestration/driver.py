"""Driver-side handles of the Ray actors: the trainer group, the rollout side, the weight sync.

train_rl.py's loop calls one method of these per stage; everything here runs in the driver.
"""
import logging
import os

import ray

from orchestration.stop_signals import stop_signals_blocked_in_children
from vime.errors import require


class WeightSyncError(RuntimeError):
    """A rollout worker's weights differ from the trainer's after a sync."""


class TrainerGroup:
    """TP x PP x DP TrainerActors joined by torch.distributed."""

    def __init__(self, cfg, load=None, placement=None):
        from trainer.config import TrainerConfig
        from trainer.ray_actor import TrainerActor

        t = cfg.train
        self.world = t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.data_parallel_size
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
        self.tp_pp = self.world // self.dp

    def train(self, samples):
        """Each DP rank trains on its share; returns rank 0's metrics (already DP-reduced)."""
        shards = [samples[d::self.dp] for d in range(self.dp)]
        futures = [a.train.remote(shards[rank // self.tp_pp], self.steps_per_rollout)
                   for rank, a in enumerate(self.actors)]
        return ray.get(futures)[0]

    def save(self, path):
        ray.get([a.save.remote(path) for a in self.actors])


class GroupBroadcast:
    """The default transport: trainer rank 0 broadcasts buckets to the rollout workers over a
    torch.distributed group of their own (gloo on CPU, NCCL on GPU, across nodes), and each
    worker loads them into its backend (vLLM: a file in shared memory, reloaded in place)."""

    needs_gpus = False

    def __init__(self, trainers, workers, run_cfg):
        self.trainers, self.workers = trainers, workers
        layouts = ray.get([a.weight_layout.remote(run_cfg.update_weight_buffer_size) for a in trainers.actors])
        layout, world = layouts[0], 1 + len(workers)
        master_addr, port = ray.get(trainers.actors[0].rendezvous.remote())  # trainer rank 0 hosts the broadcast
        backend = "nccl" if ray.cluster_resources().get("GPU", 0) else "gloo"
        joins = [trainers.actors[0].join_weight_sync.remote(master_addr, port, world, layout, backend)]
        joins += [w.join_weight_sync.remote(master_addr, port, i + 1, world, layout, backend)
                  for i, w in enumerate(workers)]
        ray.get(joins)

    def move(self, version):
        """(trainer rank 0's report, each worker's fingerprint) of one push."""
        sent = [a.send_weights.remote() for a in self.trainers.actors]
        received = ray.get([w.receive_weights.remote(version) for w in self.workers])
        return ray.get(sent)[0], received


class VLLMNcclTransfer:
    """--vllm-weight-transfer nccl: trainer rank 0 broadcasts straight into every engine's vLLM
    worker through vLLM's weight transfer engine, the target and then the drafter
    (trainer/vllm_transfer.py); GPU only."""

    needs_gpus = True

    def __init__(self, trainers, workers, run_cfg):
        self.trainers, self.workers = trainers, workers
        self.plan = ray.get(workers[0].transfer_plan.remote())
        master_addr, port = ray.get(trainers.actors[0].rendezvous.remote())
        world = 1 + len(workers)  # one vLLM worker per engine (no tensor parallelism inside an engine)
        joins = [a.join_vllm_transfer.remote(master_addr, port, world) for a in trainers.actors]
        joins += [w.join_vllm_transfer.remote(master_addr, port, i + 1, world) for i, w in enumerate(workers)]
        ray.get(joins)
        self.infos = ray.get([a.vllm_transfer_infos.remote(self.plan) for a in trainers.actors])[0]

    def move(self, version):
        sent = [a.send_vllm_transfer.remote(self.plan) for a in self.trainers.actors]
        received = ray.get([w.receive_vllm_transfer.remote(self.infos, version) for w in self.workers])
        return ray.get(sent)[0], received


TRANSPORTS = {"reload": GroupBroadcast, "nccl": VLLMNcclTransfer}  # --vllm-weight-transfer


def check_transport_fits(transport):
    """Before any actor starts: a GPU-only transport needs a cluster with GPUs."""
    require(not TRANSPORTS[transport].needs_gpus or ray.cluster_resources().get("GPU", 0) > 0,
            f"--vllm-weight-transfer {transport} moves weights between GPUs and this Ray cluster has none; "
            "use --vllm-weight-transfer reload")


class WeightSync:
    """Trainer rank 0 -> every rollout worker, versioned and verified after each push."""

    PARTS = {"mtp": "draft (MTP)", "trunk": "target (trunk)"}

    def __init__(self, trainers, workers, run_cfg, sync_draft=True, transport="reload"):
        self.trainers, self.workers = trainers, workers
        self.check_all = run_cfg.check_weight_update_equal
        self.sync_draft = sync_draft  # False: target-only sync, a stale draft is reported, not fatal
        self.warned_stale = False
        self.transport = TRANSPORTS[transport](trainers, workers, run_cfg)

    def push(self, version):
        """Broadcast all weights, then prove every worker holds the trainer's (stop if not)."""
        trainer, received = self.transport.move(version)
        stale = self._check_fingerprints(version, trainer, received)
        if self.check_all:
            self._compare_every_tensor(version)
        return {"weight_sync/bytes": trainer["bytes"], "weight_sync/seconds": max(r["seconds"] for r in received),
                "weight_sync/bytes_per_s": trainer["bytes"] / max(max(r["seconds"] for r in received), 1e-9),
                "weight_sync/mtp_checksum": trainer["mtp_checksum"][0],
                "weight_sync/trunk_checksum": trainer["trunk_checksum"][0],
                "weight_sync/worker_mtp_checksum": (received[0]["mtp_checksum"] or [float("nan")])[0],
                "rollout/weight_version_synced": version, "weight_sync/draft_stale": int(stale)}

    def _check_fingerprints(self, version, trainer, received):
        """Stop on any difference, except a stale draft under target-only sync (returns True then)."""
        stale = False
        for i, got in enumerate(received):
            for part, what in self.PARTS.items():
                if got[f"{part}_checksum"] in (trainer[f"{part}_checksum"], None):  # None: holds no such part
                    continue
                if part == "mtp" and not self.sync_draft:
                    stale = True
                    continue
                raise WeightSyncError(
                    f"weight sync v{version}: rollout worker {i}'s {what} weights differ from the trainer's "
                    f"(checksum {got[f'{part}_checksum']} vs {trainer[f'{part}_checksum']}); stopping")
        if stale and not self.warned_stale:
            self.warned_stale = True
            print(f"[vime] weight sync v{version}: the rollout draft (MTP) is stale — "
                  "--no-sync-draft-weights syncs only the target", flush=True)
        return stale

    def _compare_every_tensor(self, version):
        reference = ray.get([a.digests.remote() for a in self.trainers.actors])[0]
        for i, got in enumerate(ray.get([w.digests.remote() for w in self.workers])):
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
    """Join --ray-address (its own token auth applies) or start a local cluster closed to strangers:
    Ray's token authentication stays on (a new local cluster writes its token under ~/.ray/ and
    refuses clients without it), and no dashboard or debugger listens (they would bind ports of
    their own). Ray's GCS, raylet and object servers bind every interface; the token guards them."""
    from vime.config import REPO_ROOT

    from orchestration.placement import code_runtime_env

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
        ray.init(address=run_cfg.ray_address, runtime_env=env, log_to_driver=True)
    else:
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":  # unset: Ray turns token auth on
            print("[vime] RAY_AUTH_MODE=disabled: this Ray cluster accepts any client that reaches it", flush=True)
        with stop_signals_blocked_in_children():  # a signal to the whole job reaches only the driver
            ray.init(num_cpus=max(os.cpu_count() or 1, needed_cpus), include_dashboard=False, runtime_env=env,
                     log_to_driver=True, configure_logging=False)

