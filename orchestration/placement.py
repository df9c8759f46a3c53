"""Where the run's actors go, and how their code gets there.

One Ray placement group holds a bundle per trainer rank and one per rollout engine (with
`--colocate`, one bundle per rank holds that rank and one engine, as slime colocates them; a
cluster with fewer GPUs than ranks + engines gets the same pairs). GPU shares are Ray's: a
fraction of at most 1 lives on one GPU, so a paired rank and engine share theirs and take turns on
it. Which device an actor computes on is its own finding (`torch.cuda.is_available()` inside it),
never this module's: a cluster that declares a logical GPU on a CPU-only machine runs on CPU.
Before anything is reserved the bundles are checked against the cluster's resources, so a
placement that cannot fit is one line naming what is missing (exit 2), and the wait for the
group is bounded (`--placement-timeout`): a run never hangs waiting for resources.

The code reaches every node through Ray's `runtime_env` `working_dir` (this repository, without
checkpoints and run outputs), not a path that only exists on the driver's machine.
"""
import json
import os
from dataclasses import dataclass

from trainer.weight_senders import IN_PLACE
from vime.errors import UserError, require

# what the working_dir upload leaves out: history, weights, run outputs (their paths stay absolute on the driver),
# and the GPU machine's package bundle (.gpu/: installed outside the checkout, reached through PYTHONPATH; its
# 16 MiB archive made Ray print a size warning at every start)
CODE_EXCLUDES = [".git", "checkpoints", "runs", "docs", "**/__pycache__", "*.safetensors", "*.pkl", "wandb", ".gpu"]
STRATEGY = {True: "STRICT_PACK", False: "PACK"}  # one trainer node: strictly one node; more: packed


def code_runtime_env(repo_root):
    """runtime_env fields that ship the code to every node (merged into init_ray's env)."""
    # our excludes name .git themselves: Ray's own default list would add a warning line to every run
    os.environ.setdefault("RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES", "")
    return {"working_dir": repo_root, "excludes": CODE_EXCLUDES}


def resources_flag(text, flag):
    """A --*-resources JSON value as {name: amount}, with a one-line error."""
    if isinstance(text, dict):
        value = text
    else:
        try:
            value = json.loads(text) if text else {}
        except json.JSONDecodeError as e:
            raise UserError(f"{flag} {text!r}: not JSON ({e.msg}); give e.g. '{{\"trainer_node\": 1}}'") from None
    require(isinstance(value, dict) and all(isinstance(v, (int, float)) and v > 0 for v in value.values()),
            f"{flag} {text!r}: give a JSON object of resource name -> positive amount")
    require(not {"CPU", "GPU", "memory"} & set(value),
            f"{flag}: CPU and GPU have their own flags (--actor-num-cpus-per-node, --rollout-num-cpus-per-engine ...)")
    return dict(value)


def check_placement_flags(cfg):
    """Checks that need no cluster: the layout can be placed at all (preflight calls this)."""
    p, r, run = cfg.placement, cfg.rollout, cfg.run
    world = cfg.train.world_size
    # the flags' own ranges are in vime.config.RANGES, checked before this
    require(world % p.actor_num_nodes == 0, f"--actor-num-nodes {p.actor_num_nodes} must divide the {world} trainer "
            "ranks (TP x PP x DP) so that every node holds as many")
    resources_flag(p.actor_resources, "--actor-resources")
    resources_flag(p.rollout_resources, "--rollout-resources")
    check_gpu_shares(p, world // p.actor_num_nodes)
    if not p.colocate:
        return
    require(not (run.debug_rollout_only or run.debug_train_only),
            "--colocate shares bundles between rollout engines and trainer ranks; a debug run starts only one "
            "side: drop --colocate")
    require(r.rollout_num_workers == world,
            f"--colocate puts one rollout engine with each trainer rank: --rollout-num-workers "
            f"{r.rollout_num_workers} must equal the {world} trainer ranks (TP x PP x DP)")
    require(not run.async_rollout, "--colocate: a colocated engine and trainer rank share their devices and take "
            "turns, so the rollout cannot run during training; drop --async-rollout or --colocate")


def check_gpu_shares(p, ranks_per_node):
    """Fractions of a GPU as Ray takes them: an actor's share is at most 1 (a fraction lives on one GPU) or
    whole GPUs, and a colocated rank and engine that share a GPU fit on it."""
    if p.actor_num_gpus_per_node is not None:
        per_rank = p.actor_num_gpus_per_node / ranks_per_node
        require(_placeable(per_rank),
                f"--actor-num-gpus-per-node {p.actor_num_gpus_per_node:g} over the {ranks_per_node} trainer rank(s) "
                f"of a node is {per_rank:g} GPU each: Ray places a fraction of a GPU on one GPU, so a rank takes "
                f"at most 1 or whole GPUs; give at most {ranks_per_node} or a multiple of it")
    engine = p.rollout_num_gpus_per_engine
    require(engine is None or _placeable(engine),
            f"--rollout-num-gpus-per-engine {engine}: Ray places a fraction of a GPU on one GPU, so an engine "
            "takes a fraction of at most 1 or whole GPUs (e.g. 0.5, 1, 2)")
    if p.colocate:
        rank, engine = colocated_shares(p, ranks_per_node)
        require(rank + engine <= 1 + 1e-9 or (rank.is_integer() and engine.is_integer()),
                f"--colocate packs a trainer rank ({rank:g} GPU, --actor-num-gpus-per-node) and a rollout engine "
                f"({engine:g} GPU, --rollout-num-gpus-per-engine) into one bundle: {rank + engine:g} GPU is neither "
                "one shared GPU nor whole GPUs; give shares that sum to at most 1 (e.g. 0.5 and 0.5) or whole GPUs")


def _placeable(share):
    return share <= 1 + 1e-9 or float(share).is_integer()


def colocated_shares(p, ranks_per_node):
    """(GPU of a rank, GPU of an engine) under --colocate on a cluster with GPUs: a share left unset is what
    the other leaves of one GPU (0.5 each when neither is set), or a whole GPU next to a whole one."""
    rank = None if p.actor_num_gpus_per_node is None else p.actor_num_gpus_per_node / ranks_per_node
    engine = p.rollout_num_gpus_per_engine
    if rank is None and engine is None:
        return 0.5, 0.5
    if rank is None:
        rank = 1 - engine if engine < 1 else 1
    if engine is None:
        engine = 1 - rank if rank < 1 else 1
    return float(rank), float(engine)


@dataclass
class Demand:
    """Resources of one trainer rank and one rollout engine, how many of each, and how many of them go
    in pairs (rank i with engine i in one bundle, sharing its GPU: --colocate, or a cluster with fewer
    GPUs than ranks + engines)."""

    rank: dict
    engine: dict
    ranks: int
    engines: int
    pairs: int = 0
    paired: tuple = None  # (rank, engine) resources inside a pair; None: `rank` and `engine`

    @property
    def colocate(self):
        return self.pairs > 0

    def bundles(self):
        """[(bundle, who)]: who = ('both', i) for a pair, else ('rank', i) | ('engine', i)."""
        rank, engine = self.paired or (self.rank, self.engine)
        return ([(_add(rank, engine), ("both", i)) for i in range(self.pairs)]
                + [(dict(self.rank), ("rank", i)) for i in range(self.pairs, self.ranks)]
                + [(dict(self.engine), ("engine", i)) for i in range(self.pairs, self.engines)])

    def who(self, kind, index):
        """The bundle key of trainer rank (kind 'rank') or engine (kind 'engine') `index`."""
        return ("both", index) if index < self.pairs else (kind, index)

    def resources(self, kind, index):
        """What trainer rank or engine `index` takes of its bundle."""
        if index < self.pairs and self.paired:
            return self.paired[kind == "engine"]
        return self.engine if kind == "engine" else self.rank

    def total(self):
        out = {}
        for bundle, _ in self.bundles():
            out = _add(out, bundle)
        return out


def _add(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def demand_of(cfg, cluster_gpus):
    """The run's `Demand` (trainers absent under --debug-rollout-only, engines under --debug-train-only).
    GPU shares come from the flags; unset, from the cluster: none without GPUs, half a GPU each for a
    colocated rank and engine, and the same packing when the cluster has fewer GPUs than ranks +
    engines (rank i with engine i, the rest a GPU each); otherwise a GPU each."""
    p = cfg.placement
    world = cfg.train.world_size
    per_node = world // p.actor_num_nodes
    ranks = 0 if cfg.run.debug_rollout_only else world
    engines = 0 if cfg.run.debug_train_only else cfg.rollout.rollout_num_workers
    unset = p.actor_num_gpus_per_node is None and p.rollout_num_gpus_per_engine is None
    packed = bool(cluster_gpus) and unset and ranks and engines and cluster_gpus + 1e-9 < ranks + engines
    if p.colocate and cluster_gpus:
        rank_gpus, engine_gpus = colocated_shares(p, per_node)
    else:
        rank_gpus = p.actor_num_gpus_per_node / per_node if p.actor_num_gpus_per_node is not None else \
            (1 if cluster_gpus else 0)
        engine_gpus = p.rollout_num_gpus_per_engine if p.rollout_num_gpus_per_engine is not None else \
            (1 if cluster_gpus else 0)
    cpus = p.actor_num_cpus_per_node if p.actor_num_cpus_per_node is not None else per_node

    def rank_and_engine(rank_gpus, engine_gpus):
        return (_nonzero({"CPU": cpus / per_node, "GPU": rank_gpus, **resources_flag(p.actor_resources, "")}),
                _nonzero({"CPU": p.rollout_num_cpus_per_engine, "GPU": engine_gpus,
                          **resources_flag(p.rollout_resources, "")}))

    rank, engine = rank_and_engine(rank_gpus, engine_gpus)
    if p.colocate:
        return Demand(rank, engine, ranks, engines, pairs=ranks)
    if packed:  # rank i and engine i share a GPU; the others keep a GPU each
        return Demand(rank, engine, ranks, engines, pairs=min(ranks, engines), paired=rank_and_engine(0.5, 0.5))
    return Demand(rank, engine, ranks, engines)


def _nonzero(d):
    return {k: v for k, v in d.items() if v}


def needed_cpus(cfg):
    """CPUs a local cluster must offer for this run's bundles (init_ray sizes a local Ray with it)."""
    return int(-(-demand_of(cfg, cluster_gpus=0).total().get("CPU", 0) // 1))


def missing_resources(demand, available, nodes):
    """One line of what does not fit, or None: the sum against the cluster's free resources, and
    each bundle against the largest node (a bundle cannot straddle nodes)."""
    total = demand.total()
    short = {k: (v, available.get(k, 0)) for k, v in total.items() if v > available.get(k, 0) + 1e-9}
    if short:
        parts = ", ".join(f"{need:g} {k} (free: {have:g})" for k, (need, have) in sorted(short.items()))
        return f"the run's placement needs {parts}: {_who(demand)}; add nodes or lower the flags"
    for bundle, who in demand.bundles():
        if not any(all(node.get(k, 0) + 1e-9 >= v for k, v in bundle.items()) for node in nodes):
            return (f"no node can hold the bundle of {who[0]} {who[1]} ({_fmt(bundle)}); the largest nodes have "
                    f"{'; '.join(_fmt(n) for n in nodes[:3])}")
    return None


def _who(demand):
    rank, engine = _fmt(demand.rank), _fmt(demand.engine)
    layout = f"{demand.pairs} rank(s) each with an engine in one bundle, " if demand.pairs else ""
    return f"{layout}{demand.ranks} trainer rank(s) x {{{rank}}} + {demand.engines} rollout engine(s) x {{{engine}}}"


def _fmt(d):
    return ", ".join(f"{k}: {v:g}" for k, v in sorted(d.items()) if not k.startswith("node:") and k != "memory"
                     and not k.startswith("object_store"))


class Placement:
    """The run's placement group and the Ray options that put each actor into its bundle."""

    def __init__(self, cfg):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        cluster_gpus = ray.cluster_resources().get("GPU", 0)
        self.demand = demand_of(cfg, cluster_gpus)
        nodes = sorted((dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")),
                       key=lambda n: -n.get("CPU", 0))
        problem = missing_resources(self.demand, ray.available_resources(), nodes)
        require(problem is None, problem or "")
        if self.demand.pairs and not cfg.placement.colocate:
            print(f"[vime] the cluster has {cluster_gpus:g} GPU(s) for {self.demand.ranks} trainer rank(s) + "
                  f"{self.demand.engines} rollout engine(s): {self.demand.pairs} rank(s) share a GPU with an "
                  "engine, half each, taking turns", flush=True)
        bundles = [b for b, _ in self.demand.bundles()]
        self.where = {who: i for i, (_, who) in enumerate(self.demand.bundles())}
        strategy = STRATEGY[cfg.placement.actor_num_nodes == 1 and (self.demand.colocate or not self.demand.engines)]
        self.pg = placement_group(bundles, strategy=strategy if self.demand.ranks else "PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=cfg.placement.placement_timeout)
        if not ready:
            remove_placement_group(self.pg)
            raise UserError(f"--placement-timeout {cfg.placement.placement_timeout:g}: the placement group "
                            f"({_who(self.demand)}) was not placed in time; the cluster's free resources: "
                            f"{_fmt(ray.available_resources())}")

    def release(self, wait_s=60.0):
        """Give the placement group back (its actors gone) and wait until the cluster holds its resources
        free again: the trainer restart places the run anew at once."""
        import time

        import ray
        from ray.util.placement_group import remove_placement_group

        total = self.demand.total()
        remove_placement_group(self.pg)
        deadline = time.time() + wait_s
        while time.time() < deadline and missing_resources(self.demand, ray.available_resources(), [total]):
            time.sleep(0.2)

    def _options(self, kind, index, resources):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.where[self.demand.who(kind, index)]
        return {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)}

    def trainer_options(self, rank):
        return self._options("rank", rank, self.demand.resources("rank", rank))

    def engine_options(self, index):
        return self._options("engine", index, self.demand.resources("engine", index))

    def trainer_threads(self):
        """Torch threads of a trainer rank: the CPUs its bundle reserved for it (at least one)."""
        from vime.cpu_cores import threads_for

        return threads_for(self.demand.rank.get("CPU"))

    def engine_cpus(self):
        """[{threads, cpu_slot}] per engine: its reserved CPUs and its index among the engines on its
        node (vime/cpu_cores.py turns both into the cores it computes on)."""
        from vime.cpu_cores import threads_for, node_local_slots

        slots = node_local_slots([self.node_id_of("engine", i) for i in range(self.demand.engines)])
        threads = threads_for(self.demand.engine.get("CPU"))
        return [{"threads": threads, "cpu_slot": slot} for slot in slots]

    def engine_gpu_shares(self):
        """Per engine: its share of the GPU it shares with a trainer rank (paired in one bundle), else None."""
        return [self.demand.resources("engine", i).get("GPU") if i < self.demand.pairs else None
                for i in range(self.demand.engines)]

    def node_id_of(self, kind, index):
        """The id of the node holding that rank's or engine's bundle."""
        from ray.util.placement_group import placement_group_table

        bundle = self.where[self.demand.who(kind, index)]
        return placement_group_table(self.pg)["bundles_to_node_id"][bundle]

    def node_of(self, kind, index):
        """'node <id prefix> (<its custom resources>)' holding that rank's or engine's bundle."""
        import ray

        return describe_node(self.node_id_of(kind, index), ray.nodes())


def describe_node(node_id, nodes):
    """'node 1a2b3c4d (label)': the id's prefix and the node's custom resources (how `ray start
    --resources` told the nodes apart), or its address when it has none."""
    for n in nodes:
        if n["NodeID"] == node_id:
            labels = sorted(k for k in n["Resources"] if k not in ("CPU", "GPU", "memory", "object_store_memory")
                            and not k.startswith("node:") and not k.startswith("accelerator_type"))
            return f"node {node_id[:8]} ({', '.join(labels) or n.get('NodeManagerAddress', '?')})"
    return f"node {node_id[:8]}"


class WeightRoutes:
    """Which transport takes the weights to each engine, from where the actors found themselves
    (vime/devices.py): the in-place hand-over for engines on trainer rank 0's device, the run's
    transport for the others. `engines`: {transport: [engine index]}."""

    IN_PLACE = IN_PLACE

    def __init__(self, trainer_at, engines_at, transport):
        from vime.devices import share_device

        local = [i for i, at in enumerate(engines_at) if share_device(trainer_at, at)]
        others = [i for i in range(len(engines_at)) if i not in local]
        self.engines = {t: e for t, e in ((self.IN_PLACE, local), (transport, others)) if e}
        if trainer_at["device"] == "cuda":  # NCCL joins one process per GPU
            for a, i in enumerate(others):
                for j in others[a + 1:]:
                    require(not share_device(engines_at[i], engines_at[j]),
                            f"rollout engines {i} and {j} share a GPU and both take the weights over NCCL, "
                            "which joins one process per GPU: give each engine a GPU of its own "
                            "(--rollout-num-gpus-per-engine 1) or pair each with a trainer rank (--colocate)")

    def in_place(self, transport):
        return transport == self.IN_PLACE
