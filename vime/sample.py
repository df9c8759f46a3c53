"""`Sample`: the one record that flows from rollout to trainer, and its speculation stats."""
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Speculative-decoding counts of one request (token counts, summed over verify steps)."""

    verify_steps: int = 0  # target forwards that produced tokens (plain decode steps count too)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list = field(default_factory=list)  # [i] = accepted drafts at position i
    drafted_per_pos: list = field(default_factory=list)  # [i] = drafts proposed at position i

    def to_dict(self):
        return dict(verify_steps=self.verify_steps, draft_tokens=self.draft_tokens,
                    accepted_tokens=self.accepted_tokens, accepted_per_pos=list(self.accepted_per_pos),
                    drafted_per_pos=list(self.drafted_per_pos))


@dataclass
class Sample:
    """One prompt's one response, from generation to the training batch."""

    prompt_ids: list
    index: int = 0  # position of the prompt in its batch
    sample_index: int = 0  # which of the n samples of that prompt
    prompt: str = ""
    label: str = None
    response_ids: list = field(default_factory=list)
    response: str = ""
    rollout_logprobs: list = field(default_factory=list)  # target-model log-prob per response token
    finish_reason: str = None  # "stop" | "length"
    reward: float = 0.0
    advantage: float = 0.0
    weight_version: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    draft_version: int = 0  # version of the draft (MTP / external) weights that drafted it
    # MoE models: the experts each MoE decoder layer chose per position, [len(tokens) - 1, layers, k]
    # small integers (vime/models/routing_replay.py); None for dense models
    routed_experts: object = None

    @property
    def tokens(self):
        return list(self.prompt_ids) + list(self.response_ids)

    @property
    def loss_mask(self):
        """Per token of `tokens`: 1 on response tokens, 0 on the prompt."""
        return [0] * len(self.prompt_ids) + [1] * len(self.response_ids)


def samples_for_prompts(prompt_ids_list, n=1):
    """Fresh Samples to generate: n per prompt (index = the prompt's position, sample_index = 0..n-1)."""
    return [Sample(prompt_ids=list(ids), index=i, sample_index=j) for i, ids in enumerate(prompt_ids_list)
            for j in range(n)]
