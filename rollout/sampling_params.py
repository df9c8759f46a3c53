"""Sampling parameters of a generate call, validated with one-line errors naming the flag."""
from dataclasses import dataclass, field

from vime.errors import require


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: temperature (0 = greedy), top-p/top-k, length, stop tokens, seed,
    and whether the model's EOS ends it (`ignore_eos`, vLLM's parameter of that name)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    stop_token_ids: tuple = field(default_factory=tuple)  # in addition to the model's EOS
    seed: int = 0
    ignore_eos: bool = False  # generate max_new_tokens regardless of the model's EOS (benchmarks: equal work)

    def __post_init__(self):
        require(self.max_new_tokens > 0, f"--max-new-tokens must be > 0 (got {self.max_new_tokens})")
        require(self.temperature >= 0, f"--temperature must be >= 0 (got {self.temperature}); use 0 for greedy")
        require(0 < self.top_p <= 1, f"--top-p must be in (0, 1] (got {self.top_p})")
        require(self.top_k >= 0, f"--top-k must be >= 0 (got {self.top_k}); 0 turns it off")

    @property
    def greedy(self):
        return self.temperature == 0


def request_seed(sampling, sample):
    """The seed of one request's random stream: the call's seed with the sample's prompt index
    and sample index, so a request draws the same numbers whatever batch it runs in (both
    backends seed their per-request generators with it)."""
    return hash((sampling.seed, sample.index, sample.sample_index)) & 0x7FFFFFFF
