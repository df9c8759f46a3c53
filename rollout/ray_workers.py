"""Ray rollout actors: `RolloutWorker` (one rollout backend, embedded or vLLM) and `RolloutManager`
(prompts -> n samples each across the workers -> rewards -> advantages -> metrics)."""
import dataclasses
import functools
import os
import time

import ray
import torch

from rollout.advantages import assign_advantages
from rollout.data import PromptDataset, read_prompt_file
from rollout.health import EngineDead, EnginesLost, EngineWatch, first_line, lost_reason
from rollout.group_batching import DynamicBatch, groups_of, renumber, spread_groups, zero_signal_share
from rollout.rewards import make_scorer
from rollout.sampling_params import SamplingParams
from rollout.spec_stats import add_counters, empty_counters, spec_rates
from vime.devices import phase_memory, reset_peak_memory
from vime.sample import Sample


def engine_call(method):
    """A worker method that calls into the backend: when its engine died under it (vLLM's EngineCore
    process), the worker closes what is left of the engine and says so with `EngineDead` (it must be
    replaced), instead of the engine's own error (vLLM's EngineDeadError)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            if self.backend.alive():
                raise
            self.backend.close()
            raise EngineDead(f"its {self.backend.name} engine process died ({type(e).__name__})") from None
    return call


class RolloutWorkerImpl:
    """One rollout backend (rollout/backend.py: embedded or vLLM) plus its end of the weight push
    (the backend's receiver for the run's transport, rollout/weight_receiver.py). `heartbeat` answers on
    a thread of its own, beside a running call (rollout/health.py); a replacement for a lost worker first
    removes what its predecessor's engine left behind (`reap`)."""

    def __init__(self, hf_checkpoint, spec_config, max_batch_size, threads=1, backend="embedded", sync_draft=True,
                 spec_adaptive=False, time_plain_baseline=False, bf16=False, cpu_slot=0, weight_transfer="reload",
                 enforce_eager=False, gpu_share=None, release_kv_cache=None, release_weights=False, context_len=None,
                 reap=None):
        from rollout.backend import build_backend
        from rollout.health import reap as reap_leftovers
        from vime.cpu_cores import cores_for_slot
        from vime.precision import compute_dtype

        reap_leftovers(reap)  # before this engine starts: the lost one's processes hold memory
        self.backend, self.buckets_received = None, 0
        device = "cuda" if torch.cuda.is_available() else "cpu"  # this process's own finding
        cores = cores_for_slot(os.sched_getaffinity(0), cpu_slot, threads) if device == "cpu" else None
        torch.set_num_threads(len(cores) if cores else threads)
        # memory by turns: asked for, or (unset) for an engine that shares a CUDA GPU with a trainer rank
        shares = gpu_share is not None and device == "cuda"
        self.release_kv = shares if release_kv_cache is None else release_kv_cache
        self.release_weights = release_weights
        sharing = {"gpu_share": gpu_share, "release_memory": self.release_kv or release_weights} if shares else None
        self.backend = build_backend(backend, hf_checkpoint, spec_config, max_batch_size, device, adaptive=spec_adaptive,
                                     dtype=compute_dtype(bf16), cpu_cores=cores, weight_transfer=weight_transfer,
                                     enforce_eager=enforce_eager, sharing=sharing, context_len=context_len)
        self.sync_draft = sync_draft
        self.time_plain_baseline, self.calls = time_plain_baseline, 0
        self.receiver = None
        self.draft_version = 0  # the checkpoint's draft until a push loads one

    @ray.method(concurrency_group="health")
    def heartbeat(self):
        """Answered on its own thread while another call runs: the progress count (engine steps taken and
        weight buckets received so far), which a hung or stopped engine no longer moves. An engine that died
        under this worker is `EngineDead` at once: the running call may wait on it for ever (vLLM's client
        waits on the dead EngineCore's output queue)."""
        if self.backend is not None and not self.backend.alive():
            raise EngineDead(f"its {self.backend.name} engine process died")
        return (self.backend.progress() if self.backend else 0) + self.buckets_received

    def leftovers(self):
        """What this worker's engine started that a SIGKILL of the worker would leave (rollout/health.py)."""
        from rollout.health import engine_leftovers

        return engine_leftovers()

    @engine_call
    def generate(self, samples, sampling):
        """(samples, the backend's stats of this call: seconds, generated tokens, spec counters, spec_k_mean,
        the call's memory (vime/devices.py `phase_memory`), ...); each sample is stamped with the version
        of the weights that generated it (the driver compares it with the trainer's step)."""
        reset_peak_memory()
        if self.time_plain_baseline:  # plain first on every other call: drift hits both sides alike
            baseline = self.backend.generate_with_plain_baseline(samples, sampling, plain_first=self.calls % 2 == 0)
        else:
            baseline = {}
            self.backend.generate(samples, sampling)
        self.calls += 1
        for s in samples:
            s.weight_version, s.draft_version = self.backend.weight_version, self.draft_version
        return samples, dict(self.backend.stats(), memory=phase_memory("rollout"), **baseline)

    @engine_call
    def release_memory(self):
        """Memory by turns, once the rollout is done and the trainer steps: the backend gives back its KV
        cache (and with --rollout-release-weights its weights) when this engine takes turns; returns
        what this process holds while the trainer steps."""
        if self.release_kv or self.release_weights:
            self.backend.release_memory(weights=self.release_weights)
        return phase_memory("engine_while_training", peak=False)

    def device_identity(self):
        """Where this engine computes (vime/devices.py): its node, its Ray GPUs, torch's device here."""
        from vime.devices import device_identity

        return device_identity(ray.get_runtime_context().get_node_id(), ray.get_gpu_ids())

    def weight_plan(self, transport):
        """Take the backend's receiver for `transport`; returns what the trainer's sender must know of
        this engine. With sync_draft False (the target-only benchmark arm) the receiver leaves the
        drafter's weights as they are, and the guard reports the draft stale."""
        from vime.weight_sync import abandon

        if self.receiver is not None:  # a new push group after an engine was lost: the old one had it
            abandon(getattr(self.receiver, "group", None))
        self.receiver = self.backend.weight_receiver(transport, keep_draft=self.sync_draft)
        return self.receiver.plan()

    def join_weight_sync(self, rendezvous, rank):
        """Join trainer rank 0's push group at `rank` (blocks until every member joined)."""
        self.receiver.join(rendezvous, rank)
        return rank

    @engine_call
    def receive_weights(self, header, version, note=None, aborted=None):
        """pause -> receive the push into the backend -> resume; returns the backend's fingerprint
        (target and draft checksums) and the seconds it took. `note`: what the sender said with this
        push (the in-place hand-over's handles); `aborted()`: whether the driver gave the push up (a
        member of its group was lost; the receive then ends with PushBroken and the worker joins anew)."""
        start = time.perf_counter()
        self.receiver.aborted, self.receiver.progressed = aborted, self._bucket_received
        self.backend.pause()
        try:
            self.receiver.receive(header, version, note)
        finally:  # a broken push leaves the weights part-loaded: the next push, checked, replaces them
            self.backend.resume()
        if self.sync_draft:
            self.draft_version = version
        fp = self.backend.fingerprint()
        return {"draft_checksum": fp["draft"], "target_checksum": fp["target"], "seconds": time.perf_counter() - start}

    def _bucket_received(self):
        self.buckets_received += 1

    @engine_call
    def digests(self):
        return self.backend.digests()

    def weight_version(self):
        return self.backend.weight_version

    def close(self):
        self.backend.close()


# "health": the heartbeat's own thread, so that it answers while generate or a push runs
RolloutWorker = ray.remote(concurrency_groups={"health": 1})(RolloutWorkerImpl)


def sampling_for(rollout_cfg, step, draw=0):
    """The step's sampling parameters; the seed moves with the step (and the draw of dynamic
    sampling) so resumed runs repeat."""
    return SamplingParams(temperature=rollout_cfg.rollout_temperature, top_p=rollout_cfg.rollout_top_p,
                          top_k=rollout_cfg.rollout_top_k, max_new_tokens=rollout_cfg.rollout_max_response_len,
                          seed=rollout_cfg.rollout_seed * 1000003 + step + draw * 1_000_000_007)


class RolloutManagerImpl:
    """Owns the prompt data, the rollout workers, the reward and the advantage estimator."""

    def __init__(self, rollout_cfg, hf_checkpoint, advantage_estimator, worker_options=None, bf16=False,
                 worker_cpus=None, worker_gpu_shares=None):
        from vime.models.hf_format import read_config
        from rollout.tokenizer import TextCodec

        self.cfg = rollout_cfg
        self.advantage_estimator = advantage_estimator
        self.codec = TextCodec(hf_checkpoint)
        self.bos = read_config(hf_checkpoint).bos_token_id
        rows = read_prompt_file(rollout_cfg.prompt_data, rollout_cfg.input_key, rollout_cfg.label_key,
                                apply_chat_template=rollout_cfg.apply_chat_template)
        self.data = PromptDataset(rows, rollout_cfg.rollout_batch_size, rollout_cfg.rollout_seed,
                                  rollout_cfg.rollout_shuffle)
        self.eval_rows = read_prompt_file(rollout_cfg.eval_prompt_data, rollout_cfg.input_key, rollout_cfg.label_key,
                                          apply_chat_template=rollout_cfg.apply_chat_template,
                                          flag="--eval-prompt-data") if rollout_cfg.eval_prompt_data else []
        self.scorer = make_scorer(rollout_cfg.rm_type, rollout_cfg.custom_rm_path, rollout_cfg.reward_timeout,
                                  rollout_cfg.reward_num_workers)
        self.reward_counts = {}  # the scorer's counts (timeouts, unparsable labels) over one step's draws
        self.warned_bound = False  # dynamic sampling's bound is said once, counted every step
        context_len = self._context_len(rows + self.eval_rows)
        n = rollout_cfg.rollout_num_workers
        self.hf_checkpoint, self.bf16 = hf_checkpoint, bf16
        self.context_len = context_len
        self.worker_options = worker_options or [worker_resources()] * n  # placed, or anywhere
        self.worker_cpus = worker_cpus or [{"threads": 1, "cpu_slot": i} for i in range(n)]  # {threads, cpu_slot}
        self.worker_gpu_shares = worker_gpu_shares or [None] * n  # its GPU share where it shares one with a rank
        self.workers = [self._start_worker(i) for i in range(n)]
        self.leftovers = {}  # worker index -> what its engine started (rollout/health.py), once it answered
        self.watch = EngineWatch(rollout_cfg.rollout_health_timeout)
        self.step_start = None  # (step, data cursor before it) of the step being generated
        self.kept = {}  # (draw, prompt index) -> (weight version, its group's samples) generated this step
        self.issued = set()  # (draw, prompt index) of the groups sent to an engine this step
        self.reissued = 0  # groups (prompts) sent again this step because their engine was lost

    def _start_worker(self, i, reap=None):
        """Worker `i` on its placement (its bundle, cores and GPU share); `reap`: what a lost predecessor
        on that placement left behind, removed before the engine starts."""
        r = self.cfg
        return RolloutWorker.options(**self.worker_options[i]).remote(
            self.hf_checkpoint, r.vllm_speculative_config, r.rollout_max_batch_size,
            backend=r.backend, sync_draft=r.sync_draft_weights, spec_adaptive=r.spec_adaptive,
            time_plain_baseline=r.time_plain_baseline, bf16=self.bf16, weight_transfer=r.vllm_weight_transfer,
            enforce_eager=r.enforce_eager, gpu_share=self.worker_gpu_shares[i], release_kv_cache=r.release_kv_cache,
            release_weights=r.release_weights, context_len=self.context_len, reap=reap, **self.worker_cpus[i])

    def _context_len(self, rows):
        """The positions a request of this run can reach: its longest prompt (training and evaluation) plus
        --rollout-max-response-len (the pre-start checks keep that within the model's context)."""
        chat = self.cfg.apply_chat_template
        return max(len(self.codec.prompt_ids(p, self.bos, chat)) for p, _ in rows) + self.cfg.rollout_max_response_len

    def get_workers(self):
        return self.workers

    def started(self):
        """Wait until every worker's engine runs; record what each started (for `replace_workers`)."""
        for i, found in enumerate(ray.get([w.leftovers.remote() for w in self.workers])):
            self.leftovers[i] = found
        return len(self.workers)

    def replace_workers(self, indices):
        """A new worker in place of each lost one (killed first if it still runs), on the same placement,
        after its predecessor's engine processes and rings are removed; waits until each runs (at most
        --rollout-health-timeout, or it counts as lost again). Returns the workers, all of them."""
        fresh = {}
        for i in indices:
            ray.kill(self.workers[i], no_restart=True)
            fresh[i] = self._start_worker(i, reap=self.leftovers.pop(i, None))
        outcomes = self.watch.wait_started({i: w.leftovers.remote() for i, w in fresh.items()})
        failed = []
        for i, w in fresh.items():
            self.workers[i] = w
            if isinstance(outcomes[i], BaseException):
                ray.kill(w, no_restart=True)
                failed.append((i, w._actor_id.hex(), f"did not start again: {first_line(outcomes[i])}"))
            else:
                self.leftovers[i] = outcomes[i]
        if failed:
            raise EnginesLost(None, failed)
        return self.workers

    def release_memory(self):
        """Memory by turns: every engine lets go of what it may while the trainer steps; the largest
        memory an engine then holds (memory/engine_while_training_*)."""
        return _largest(list(self._on_every_worker(lambda w: w.release_memory.remote(), None).values()))

    def _on_every_worker(self, call, step):
        """{worker index: value} of `call(worker)` on every worker, watched (rollout/health.py); EnginesLost
        when a worker was lost, after the others finished."""
        return self._watched({i: (w, call(w)) for i, w in enumerate(self.workers)}, step)

    def _watched(self, calls, step):
        """{index: value} of calls {index: (worker, ref)} to workers; EnginesLost naming the lost ones."""
        outcomes, lost = self._watch(calls, step)
        if lost:
            raise lost
        return outcomes

    def _watch(self, calls, step):
        """({index: value} of the calls that succeeded, EnginesLost naming the lost workers or None); any
        other error of a call is raised as it is."""
        outcomes = self.watch.wait(calls)
        lost = []
        for i, outcome in sorted(outcomes.items()):
            if isinstance(outcome, BaseException):
                why = lost_reason(outcome)
                if why is None:
                    raise outcome
                lost.append((i, calls[i][0]._actor_id.hex(), why))
        values = {i: v for i, v in outcomes.items() if not isinstance(v, BaseException)}
        return values, EnginesLost(step, lost) if lost else None

    def data_cursor(self):
        return self.data.cursor

    def set_data_cursor(self, cursor):
        self.data.cursor = cursor

    def _samples(self, prompts, version):
        n = self.cfg.n_samples_per_prompt
        chat = self.cfg.apply_chat_template
        return [Sample(prompt_ids=self.codec.prompt_ids(p, self.bos, chat), index=i, sample_index=j,
                       prompt=self.codec.render_chat(p) if chat else p, label=label, weight_version=version)
                for i, (p, label) in enumerate(prompts) for j in range(n)]

    def generate(self, step, version=None):
        """One step's samples with rewards and advantages, and the rollout/* + perf/* metrics.
        With --dynamic-sampling, draws until the batch holds only groups with signal (bounded).

        A step that lost engines (EnginesLost) is generated again once they are replaced: the same
        prompts (the data cursor goes back to the step's start), and only the groups not generated
        yet, unless the ones kept were generated with other weights than `version` (the weights the
        workers hold now): then those groups are generated again too."""
        start = time.perf_counter()
        if self.step_start is not None and self.step_start[0] == step:
            self.data.cursor = self.step_start[1]
            self.kept = {key: held for key, held in self.kept.items() if version is None or held[0] == version}
        else:
            self.step_start, self.kept, self.issued, self.reissued = (step, self.data.cursor), {}, set(), 0
        self.reward_counts = {}
        samples, done, engine_time = self._draw(self.data.next_prompts(self._prompts_per_draw()), step, draw=0)
        drawn, extra = samples, {}
        if self.cfg.dynamic_sampling:
            samples, drawn, done, engine_time, extra = self._dynamic_batch(samples, done, engine_time, step)
        elapsed = time.perf_counter() - start
        counters = functools.reduce(add_counters, [stats["spec"] for stats in done], empty_counters())
        extra["rollout/zero_signal_share"] = zero_signal_share(groups_of(samples))
        assign_advantages(samples, self.advantage_estimator)
        self.step_start, self.kept = None, {}
        extra["fault/prompts_reissued"] = self.reissued
        return samples, dict(self._metrics(drawn, elapsed, counters), **{"perf/rollout_engine_time": engine_time},
                             **_adaptive_metrics(done), **_plain_baseline_metrics(done, engine_time), **extra,
                             **_largest([stats["memory"] for stats in done]),
                             **{f"rollout/{k}": v for k, v in self.reward_counts.items()})

    def _prompts_per_draw(self):
        dynamic = self.cfg.dynamic_sampling and self.cfg.over_sampling_batch_size
        return self.cfg.over_sampling_batch_size if dynamic else self.cfg.rollout_batch_size

    def _draw(self, prompts, step, draw):
        """Generate n samples of each prompt on the workers (whole groups, spread by load) and score
        them: (samples in prompt order with rewards, each worker's stats of the call). Groups already
        generated in an attempt of this step that lost engines are kept (`generate`)."""
        groups = groups_of(self._samples(prompts, version=step))
        todo = [g for g in groups if (draw, g[0].index) not in self.kept]
        self.reissued += sum((draw, g[0].index) in self.issued for g in todo)
        self.issued |= {(draw, g[0].index) for g in todo}
        shards = spread_groups(todo, len(self.workers), self.cfg.rollout_max_response_len)
        sampling = sampling_for(self.cfg, step, draw)
        calls = {i: (w, w.generate.remote(shard, sampling)) for i, (w, shard) in enumerate(zip(self.workers, shards))
                 if shard}
        outcomes, lost = self._watch(calls, step)
        done = [outcomes[i] for i in sorted(outcomes)]
        for shard, _ in done:  # kept before a loss is reported: the next attempt generates only the others
            for group in groups_of(shard):
                self.kept[(draw, group[0].index)] = (group[0].weight_version, group)
        if lost:
            raise lost
        samples = sorted([s for g in groups for s in self.kept[(draw, g[0].index)][1]],
                         key=lambda s: (s.index, s.sample_index))
        scores, counts = self.scorer.score([(s.response, s.label) for s in samples])
        for s, score in zip(samples, scores):
            s.reward = score
        for name, value in counts.items():
            self.reward_counts[name] = self.reward_counts.get(name, 0) + value
        return samples, [stats for _, stats in done], max([stats["seconds"] for _, stats in done], default=0.0)

    def _dynamic_batch(self, first, done, engine_time, step):
        """DAPO: keep the groups with signal, draw --over-sampling-batch-size more prompts until
        --rollout-batch-size groups are kept or --dynamic-sampling-max-draws is reached; then the
        batch is filled with zero-signal groups (said once, counted every step)."""
        collected, drawn = DynamicBatch(self.cfg.rollout_batch_size), list(first)
        collected.add(groups_of(first))
        draws = 1
        while not collected.full() and draws < self.cfg.dynamic_sampling_max_draws:
            more, stats, seconds = self._draw(self.data.next_prompts(self._prompts_per_draw()), step, draw=draws)
            collected.add(groups_of(more))
            drawn, done, engine_time, draws = drawn + more, done + stats, engine_time + seconds, draws + 1
        groups, filled = collected.batch()
        if filled and not self.warned_bound:
            self.warned_bound = True
            print(f"[vime] warning: dynamic sampling reached --dynamic-sampling-max-draws "
                  f"{self.cfg.dynamic_sampling_max_draws} at step {step} with {len(collected.kept)} of "
                  f"{self.cfg.rollout_batch_size} groups with signal; training on them plus {filled} zero-signal "
                  "groups (metric rollout/dynamic_sampling_filled_groups; raise the bound to avoid it)", flush=True)
        return renumber(groups), drawn, done, engine_time, {
            "rollout/dynamic_sampling_draws": draws, "rollout/dynamic_sampling_kept_fraction": collected.kept_fraction(),
            "rollout/dynamic_sampling_filled_groups": filled, "rollout/dynamic_sampling_drawn_groups": collected.drawn}

    def evaluate(self, step):
        """eval/* metrics of the held-out prompts with the workers' current weights ({} without
        --eval-prompt-data or off the --eval-interval)."""
        from rollout.evaluation import eval_metrics, is_eval_step

        if not self.eval_rows or not is_eval_step(step, self.cfg.eval_interval):
            return {}
        k = self.cfg.n_samples_per_eval_prompt
        chat = self.cfg.apply_chat_template
        samples = [Sample(prompt_ids=self.codec.prompt_ids(p, self.bos, chat), index=i, sample_index=j,
                          label=label, weight_version=step)
                   for i, (p, label) in enumerate(self.eval_rows) for j in range(k)]
        shards = [samples[i::len(self.workers)] for i in range(len(self.workers))]
        sampling = dataclasses.replace(sampling_for(self.cfg, step), temperature=self.cfg.eval_temperature,
                                       seed=self.cfg.rollout_seed * 1000003 + 7919 + step)
        done = list(self._watched({i: (w, w.generate.remote(shard, sampling))
                                   for i, (w, shard) in enumerate(zip(self.workers, shards))}, step).values())
        counters = functools.reduce(add_counters, [stats["spec"] for _, stats in done], empty_counters())
        samples = [s for shard, _ in done for s in shard]
        scores, reward_counts = self.scorer.score([(s.response, s.label) for s in samples])
        for s, score in zip(samples, scores):
            s.reward = score
        return dict(eval_metrics(samples, k, counters), **{f"eval/{n}": v for n, v in reward_counts.items()})

    def close_workers(self):
        """Stop what the backends started (vLLM's engine processes) before the actors go; what a dead
        worker's engine left on this node is removed here (a replacement removes it on its own node)."""
        from rollout.health import reap

        here = ray.get_runtime_context().get_node_id()
        for i, w in enumerate(self.workers):
            try:
                ray.get(w.close.remote())
            except ray.exceptions.RayActorError:
                if self.leftovers.get(i, {}).get("node_id") == here:
                    reap(self.leftovers.pop(i))
        self.scorer.close()

    def _metrics(self, samples, elapsed, counters):
        tokens = sum(len(s.response_ids) for s in samples)
        m = {f"rollout/{k}": v for k, v in spec_rates(counters).items()}
        m.update({
            "rollout/reward": sum(s.reward for s in samples) / len(samples),
            "rollout/num_samples": len(samples),
            "rollout/response_len": tokens / len(samples),
            "perf/rollout_time": elapsed,
            "perf/rollout_tokens_per_s": tokens / max(elapsed, 1e-9),
            "rollout/weight_version": min(s.weight_version for s in samples),
        })
        if samples[0].routed_experts is not None:  # MoE: the routes riding along to the trainer
            from vime.models.routing_replay import route_bytes

            m["rollout/route_bytes_per_sample"] = sum(route_bytes(s) for s in samples) / len(samples)
        spec = self.cfg.vllm_speculative_config
        if spec is not None and spec.block_size:  # a block draft: the block its acceptance per position spans
            m["rollout/spec_block_size"] = spec.block_size
        return m


RolloutManager = ray.remote(RolloutManagerImpl)

ADAPTIVE_STATS = ("spec_k_mean", "spec_predicted_speedup", "spec_measured_speedup")


def _adaptive_metrics(worker_stats):
    """rollout/spec_k_mean and predicted vs measured speedup (--spec-adaptive), averaged over workers."""
    out = {}
    for key in ADAPTIVE_STATS:
        values = [s[key] for s in worker_stats if key in s]
        if values:
            out[f"rollout/{key}"] = sum(values) / len(values)
    return out


def _largest(per_worker):
    """{metric: the largest value over the workers} of per-worker memory metrics."""
    return {k: max(m[k] for m in per_worker) for k in per_worker[0]} if per_worker else {}


def _plain_baseline_metrics(worker_stats, engine_time):
    """--rollout-time-plain-baseline: plain decoding's engine time for the same batch (the slowest
    worker, as for perf/rollout_engine_time), the speedup speculation had over it, and the share of
    samples plain decoding reproduced (1.0 under strict verification: both sides did the same work)."""
    if not worker_stats or "plain_seconds" not in worker_stats[0]:
        return {}
    plain = max(s["plain_seconds"] for s in worker_stats)
    same = sum(s["plain_same_responses"] for s in worker_stats) / len(worker_stats)
    return {"perf/rollout_plain_engine_time": plain, "perf/spec_speedup_vs_plain": plain / max(engine_time, 1e-9),
            "rollout/plain_same_responses": same}


def worker_resources():
    """Ray options for a rollout worker: one GPU when the cluster has GPUs, else one CPU."""
    gpus = ray.cluster_resources().get("GPU", 0)
    return {"num_gpus": 1} if gpus else {"num_cpus": 1}

