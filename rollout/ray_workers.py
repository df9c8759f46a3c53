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
from rollout.group_batching import DynamicBatch, groups_of, renumber, spread_groups, zero_signal_share
from rollout.rewards import make_scorer
from rollout.sampling_params import SamplingParams
from rollout.spec_stats import add_counters, empty_counters, spec_rates
from vime.devices import phase_memory, reset_peak_memory
from vime.sample import Sample


class RolloutWorkerImpl:
    """One rollout backend (rollout/backend.py: embedded or vLLM) plus its end of the weight push
    (the backend's receiver for the run's transport, rollout/weight_receiver.py)."""

    def __init__(self, hf_checkpoint, spec_config, max_batch_size, threads=1, backend="embedded", sync_draft=True,
                 spec_adaptive=False, time_plain_baseline=False, bf16=False, cpu_slot=0, weight_transfer="reload",
                 enforce_eager=False, gpu_share=None, release_kv_cache=None, release_weights=False, context_len=None):
        from rollout.backend import build_backend
        from vime.cpu_cores import cores_for_slot
        from vime.precision import compute_dtype

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
        self.receiver = self.backend.weight_receiver(transport, keep_draft=self.sync_draft)
        return self.receiver.plan()

    def join_weight_sync(self, rendezvous, rank):
        """Join trainer rank 0's push group at `rank` (blocks until every member joined)."""
        self.receiver.join(rendezvous, rank)
        return rank

    def receive_weights(self, header, version, note=None):
        """pause -> receive the push into the backend -> resume; returns the backend's fingerprint
        (target and draft checksums) and the seconds it took. `note`: what the sender said with this
        push (the in-place hand-over's handles)."""
        start = time.perf_counter()
        self.backend.pause()
        self.receiver.receive(header, version, note)
        if self.sync_draft:
            self.draft_version = version
        self.backend.resume()
        fp = self.backend.fingerprint()
        return {"draft_checksum": fp["draft"], "target_checksum": fp["target"], "seconds": time.perf_counter() - start}

    def digests(self):
        return self.backend.digests()

    def weight_version(self):
        return self.backend.weight_version

    def close(self):
        self.backend.close()


RolloutWorker = ray.remote(RolloutWorkerImpl)


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
        opts = worker_options or [worker_resources()] * n  # placed, or anywhere
        cpus = worker_cpus or [{"threads": 1, "cpu_slot": i} for i in range(n)]  # {threads, cpu_slot} per engine
        shares = worker_gpu_shares or [None] * n  # an engine's GPU share where it shares a GPU with a trainer rank
        self.workers = [RolloutWorker.options(**opts[i]).remote(
            hf_checkpoint, rollout_cfg.vllm_speculative_config, rollout_cfg.rollout_max_batch_size,
            backend=rollout_cfg.backend, sync_draft=rollout_cfg.sync_draft_weights,
            spec_adaptive=rollout_cfg.spec_adaptive, time_plain_baseline=rollout_cfg.time_plain_baseline,
            bf16=bf16, weight_transfer=rollout_cfg.vllm_weight_transfer, enforce_eager=rollout_cfg.enforce_eager,
            gpu_share=shares[i], release_kv_cache=rollout_cfg.release_kv_cache,
            release_weights=rollout_cfg.release_weights, context_len=context_len, **cpus[i])
            for i in range(n)]

    def _context_len(self, rows):
        """The positions a request of this run can reach: its longest prompt (training and evaluation) plus
        --rollout-max-response-len (the pre-start checks keep that within the model's context)."""
        chat = self.cfg.apply_chat_template
        return max(len(self.codec.prompt_ids(p, self.bos, chat)) for p, _ in rows) + self.cfg.rollout_max_response_len

    def get_workers(self):
        return self.workers

    def release_memory(self):
        """Memory by turns: every engine lets go of what it may while the trainer steps; the largest
        memory an engine then holds (memory/engine_while_training_*)."""
        return _largest(ray.get([w.release_memory.remote() for w in self.workers]))

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

    def generate(self, step):
        """One step's samples with rewards and advantages, and the rollout/* + perf/* metrics.
        With --dynamic-sampling, draws until the batch holds only groups with signal (bounded)."""
        start = time.perf_counter()
        self.reward_counts = {}
        samples, done, engine_time = self._draw(self.data.next_prompts(self._prompts_per_draw()), step, draw=0)
        drawn, extra = samples, {}
        if self.cfg.dynamic_sampling:
            samples, drawn, done, engine_time, extra = self._dynamic_batch(samples, done, engine_time, step)
        elapsed = time.perf_counter() - start
        counters = functools.reduce(add_counters, [stats["spec"] for stats in done], empty_counters())
        extra["rollout/zero_signal_share"] = zero_signal_share(groups_of(samples))
        assign_advantages(samples, self.advantage_estimator)
        return samples, dict(self._metrics(drawn, elapsed, counters), **{"perf/rollout_engine_time": engine_time},
                             **_adaptive_metrics(done), **_plain_baseline_metrics(done, engine_time), **extra,
                             **_largest([stats["memory"] for stats in done]),
                             **{f"rollout/{k}": v for k, v in self.reward_counts.items()})

    def _prompts_per_draw(self):
        dynamic = self.cfg.dynamic_sampling and self.cfg.over_sampling_batch_size
        return self.cfg.over_sampling_batch_size if dynamic else self.cfg.rollout_batch_size

    def _draw(self, prompts, step, draw):
        """Generate n samples of each prompt on the workers (whole groups, spread by load) and score
        them: (samples in prompt order with rewards, each worker's stats of the call)."""
        samples = self._samples(prompts, version=step)
        shards = spread_groups(groups_of(samples), len(self.workers), self.cfg.rollout_max_response_len)
        sampling = sampling_for(self.cfg, step, draw)
        done = ray.get([w.generate.remote(shard, sampling) for w, shard in zip(self.workers, shards) if shard])
        samples = sorted([s for shard, _ in done for s in shard], key=lambda s: (s.index, s.sample_index))
        scores, counts = self.scorer.score([(s.response, s.label) for s in samples])
        for s, score in zip(samples, scores):
            s.reward = score
        for name, value in counts.items():
            self.reward_counts[name] = self.reward_counts.get(name, 0) + value
        return samples, [stats for _, stats in done], max(stats["seconds"] for _, stats in done)

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
        done = ray.get([w.generate.remote(shard, sampling) for w, shard in zip(self.workers, shards)])
        counters = functools.reduce(add_counters, [stats["spec"] for _, stats in done], empty_counters())
        samples = [s for shard, _ in done for s in shard]
        scores, reward_counts = self.scorer.score([(s.response, s.label) for s in samples])
        for s, score in zip(samples, scores):
            s.reward = score
        return dict(eval_metrics(samples, k, counters), **{f"eval/{n}": v for n, v in reward_counts.items()})

    def close_workers(self):
        """Stop what the backends started (vLLM's engine processes) before the actors go."""
        ray.get([w.close.remote() for w in self.workers])
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

