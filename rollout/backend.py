"""The rollout-backend protocol and its registry: the embedded engine and vLLM, side by side.

A backend turns Samples into responses and holds the policy's weights. RolloutWorker talks
to a backend only through this protocol (`RolloutBackend`, a typing.Protocol), so nothing above the
worker knows which one runs:

    generate(samples, sampling) -> samples  fills response_ids / response / rollout_logprobs /
                                            finish_reason / weight_version of each Sample
    load_weights(named_tensors, version)    (canonical HF name, tensor) pairs, target and draft
    weight_receiver(transport, keep_draft) -> its receiving end of a push by --vllm-weight-transfer
                                            `transport` (rollout/weight_receiver.py; keep_draft False
                                            leaves the draft's weights as they are)
    fingerprint() -> {"target": [s, ss], "draft": [s, ss] or None}  weight_sync.checksum of the
                                            weights the backend serves with, under canonical names
                                            (None: it holds no draft)
    digests() -> {canonical name: sha256}   the full comparison of --check-weight-update-equal
    pause() / resume()                      around a weight update
    release_memory(weights)                 memory by turns, while a trainer on the same device steps: give
                                            the KV cache back (allocated again for the next generate) and,
                                            with `weights`, the weights too (the next push brings them back)
    stats() -> {"seconds", "generated_tokens", "spec": counters}   of the last generate call
                                            (counters as in rollout/spec_stats.py)
    progress() -> int                       engine steps taken so far (read from another thread while a
                                            call runs: the hang watch's sign of life, rollout/health.py)
    alive() -> bool                         False once an engine process the backend started has died
                                            (the worker must then be replaced)
    close()                                 release processes the backend started

`BACKEND_CHECKS` maps the same names to each backend's own pre-start check of a run's config
(`check_backend` runs the chosen one, before any actor starts). `BACKENDS` maps `--rollout-backend`
names to constructors taking
(hf_checkpoint, speculative_config, max_batch_size, device, adaptive, dtype, cpu_cores, weight_transfer,
enforce_eager, sharing, context_len);
`adaptive` is the
embedded engine's --spec-adaptive (vLLM has its own per-batch-size k in the speculative config);
`dtype` the model's (torch.bfloat16 under --bf16): weights are loaded and synced in it, and the
fingerprint sums exactly the values the backend holds in it; `cpu_cores` the cores the backend
computes on (vime/cpu_cores.py; None: torch's and vLLM's own choice); `weight_transfer`
--vllm-weight-transfer, for a backend that must prepare for its transport when it starts; `enforce_eager`
--rollout-enforce-eager (no CUDA graphs); `sharing` how the engine shares its device with a trainer rank
({"gpu_share": its fraction of the GPU, "release_memory": whether release_memory will be asked of it};
None: it has the device to itself), for a backend that sizes its memory or its allocator when it starts;
`context_len` the positions a request of the run can reach (its longest prompt plus --rollout-max-response-len;
None: the model's max_position_embeddings), which the embedded engine sizes its KV cache by (a real model's
context, 8192 positions and more, would otherwise claim gigabytes per slot); vLLM sizes its KV cache itself.

The embedded backend can also time plain decoding of the same batch right beside the real,
speculative call (`generate_with_plain_baseline`, --rollout-time-plain-baseline): a benchmark's
paired measurement of what speculation saved, free of the machine's minute-to-minute drift.
"""
import typing

import torch

from vime.models.draft_kinds import is_draft_name
from rollout.spec_stats import spec_counters
from rollout.weight_receiver import BucketReceiver, HandOverReceiver
from vime import weight_sync
from vime.sample import Sample
from vime.lazy import lazy_constructor


class RolloutBackend(typing.Protocol):
    """What RolloutWorker needs of a rollout backend (see the module docstring for each method)."""

    name: str

    def generate(self, samples: list, sampling) -> list: ...

    def load_weights(self, named_tensors, version: int) -> None: ...

    def weight_receiver(self, transport: str, keep_draft: bool = True): ...

    def fingerprint(self) -> dict: ...

    def digests(self) -> dict: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def release_memory(self, weights: bool = False) -> None: ...

    def stats(self) -> dict: ...

    def progress(self) -> int: ...

    def alive(self) -> bool: ...

    def close(self) -> None: ...


class EmbeddedBackend:
    """vime's own torch engine (the CPU default and the exactness reference)."""

    name = "embedded"

    def __init__(self, hf_checkpoint, speculative_config, max_batch_size, device="cpu", adaptive=False,
                 dtype=torch.float32, cpu_cores=None, weight_transfer="reload", enforce_eager=False, sharing=None,
                 context_len=None):
        from rollout.embedded.engine import EngineConfig
        from rollout.embedded.engine_builder import build_engine, build_proposer

        # computes on this process's torch threads (RolloutWorker sets them); allocates as it goes
        del cpu_cores, weight_transfer, sharing
        config = EngineConfig(max_batch_size=max_batch_size, device=device, dtype=dtype, enforce_eager=enforce_eager,
                              max_len=context_len)
        self.engine = build_engine(hf_checkpoint, speculative_config, config, adaptive=adaptive)
        self.plain_proposer = build_proposer(None)
        self.last_spec = spec_counters([])

    def generate(self, samples, sampling):
        self.engine.generate(samples, sampling)
        self.last_spec = spec_counters(samples)
        return samples

    def generate_with_plain_baseline(self, samples, sampling, plain_first):
        """`generate`, plus plain decoding (no drafts) of copies of the same samples back to back,
        in the order `plain_first` says (callers alternate it so drift hits both sides alike).

        Returns {"plain_seconds", "plain_same_responses"}: the plain call's engine time and the
        share of samples whose responses it reproduced (all of them under strict verification,
        bar a rare fp32 rounding flip). The samples, stats() and the k policy's state are those
        of the speculative call alone."""
        copies = [Sample(prompt_ids=s.prompt_ids, index=s.index, sample_index=s.sample_index) for s in samples]
        if plain_first:
            plain_seconds = self._generate_plain(copies, sampling)
            self.generate(samples, sampling)
        else:
            self.generate(samples, sampling)
            spec_stats = self.engine.last_stats
            plain_seconds = self._generate_plain(copies, sampling)
            self.engine.last_stats = spec_stats
        same = sum(c.response_ids == s.response_ids for c, s in zip(copies, samples))
        return {"plain_seconds": plain_seconds, "plain_same_responses": same / max(len(samples), 1)}

    def _generate_plain(self, samples, sampling):
        """Engine seconds of plain decoding; the proposer, its caches and the k policy are put back
        untouched (set_proposer would re-attach and reset them)."""
        proposer, k_policy = self.engine.proposer, self.engine.k_policy
        self.engine.set_proposer(self.plain_proposer)
        try:
            self.engine.generate(samples, sampling)
        finally:
            self.engine.proposer, self.engine.k_policy = proposer, k_policy
        return self.engine.last_stats["seconds"]

    def load_weights(self, named_tensors, version):
        self.engine.load_weights(named_tensors, version)

    def weight_receiver(self, transport, keep_draft=True):
        """vime's bucket broadcast or the in-place hand-over, loaded into the engine's parameters (the
        engine has no transport of its own)."""
        if transport not in EMBEDDED_RECEIVERS:  # the run's checks refuse any other before an actor starts
            raise ValueError(f"the embedded engine has no weight transport {transport!r}")
        return EMBEDDED_RECEIVERS[transport](self.load_weights, self.engine.cfg.num_hidden_layers, keep_draft)

    def _parts(self):
        n = self.engine.cfg.num_hidden_layers
        named = list(self.engine.named_weights())
        return {"draft": [(k, v) for k, v in named if is_draft_name(k, n)],
                "target": [(k, v) for k, v in named if not is_draft_name(k, n)]}

    def fingerprint(self):
        return {part: weight_sync.checksum(named) for part, named in self._parts().items()}

    def digests(self):
        return weight_sync.digests(self.engine.named_weights())

    def pause(self):
        self.engine.pause()

    def release_memory(self, weights=False):
        self.engine.release_memory(weights)

    def resume(self):
        self.engine.resume()

    @property
    def weight_version(self):
        return self.engine.weight_version

    def stats(self):
        st = self.engine.stats()  # also --spec-adaptive's spec_k_mean and speedups
        return dict(st, seconds=st.get("seconds", 0.0), generated_tokens=st.get("generated_tokens", 0),
                    spec=self.last_spec)

    def progress(self):
        return self.engine.steps_taken

    def alive(self):
        """The engine lives in this process: alive while the process is."""
        return True

    def close(self):
        """Nothing to release: the engine lives in this process."""


EMBEDDED_RECEIVERS = {"reload": BucketReceiver, "in_place": HandOverReceiver}  # by transport

BACKENDS = {
    "embedded": EmbeddedBackend,
    "vllm": lazy_constructor("rollout.vllm.backend", "VLLMBackend"),  # vLLM is optional
}
# each backend's own pre-start checks of a run's config against the target checkpoint: check(cfg, hf)
BACKEND_CHECKS = {
    "embedded": lazy_constructor("rollout.embedded.engine_builder", "check_config"),
    "vllm": lazy_constructor("rollout.vllm.backend", "check_config"),
}


def check_backend(cfg, hf):
    """The chosen backend's own checks of a training run against the checkpoint `hf`, before any actor starts."""
    BACKEND_CHECKS[cfg.rollout.backend](cfg, hf)


def build_backend(name, hf_checkpoint, speculative_config, max_batch_size, device="cpu",
                  adaptive=False, dtype=torch.float32, cpu_cores=None, weight_transfer="reload",
                  enforce_eager=False, sharing=None, context_len=None) -> RolloutBackend:
    return BACKENDS[name](hf_checkpoint, speculative_config, max_batch_size, device, adaptive, dtype, cpu_cores,
                          weight_transfer, enforce_eager, sharing, context_len)
