"""What a kind of draft is (pure): one `DraftKind` descriptor per kind, as `ModelFamily` is per family.

A descriptor says everything the rest of vime asks of a kind: the names vLLM gives its method, what
its speculative config's `model` must name, whether it fills a whole block in one forward or chains
its drafts one by one, which proposer drafts with it (`rollout/embedded/proposers/<name>.py`) and
which trainer trains it online (`trainer/drafts/<name>.py`) with what defaults of the shared
`--draft-*` knobs, and, for an external draft, its checkpoint format (vime/models/draft_format.py:
save, load, the fit check against the target, the wire prefix and vLLM names of its tensors).
The table of kinds is vime/models/draft_kinds.py; every table keyed by kind is derived from it.
"""
from dataclasses import dataclass
from typing import Optional

from vime.models import draft_format
from vime.models.draft_format import ExternalFormat


@dataclass(frozen=True)
class DraftKnobs:
    """The shared knobs of a draft trained online (`--draft-lr`, `--draft-steps-per-rollout`,
    `--draft-replay-batches`): a kind's defaults, or a run's values once resolved."""

    lr: float
    steps_per_rollout: int
    replay_batches: int


@dataclass(frozen=True)
class DraftKind:
    """One kind of draft: a speculative method and all that vime knows of it."""

    name: str  # the method in the speculative config, and the kind's file name everywhere
    title: str  # how messages and --help name it
    proposer: str  # the class of rollout/embedded/proposers/<name>.py that drafts with it
    aliases: tuple = ()  # vLLM's other names of the method
    trainer: Optional[str] = None  # the class of trainer/drafts/<name>.py that trains it online (None: none)
    knobs: Optional[DraftKnobs] = None  # its defaults of the shared --draft-* knobs (a kind trained online)
    block: bool = False  # fills a whole block in one forward (num_speculative_tokens = its block less the anchor)
    anchor_drafts: bool = False  # a block whose anchor slot drafts too (num_speculative_tokens = its block)
    confidence: bool = False  # its drafts carry a confidence that can size verification (enable_adaptive_verification)
    loss_weights: tuple = ()  # ((term, default weight), ...) of its loss's terms, set with --draft-<term>-weight
    vllm_gpu_runner_only: bool = False  # vLLM drafts it only in its GPU model runner: its CPU build cannot
    model: Optional[str] = None  # what its config's "model" names, when not an external draft of vime's format
    format: Optional[ExternalFormat] = None  # an external draft's checkpoint format
    legacy_state_file: Optional[str] = None  # the name its trained state had in older --save checkpoints

    @property
    def names(self):
        """Every name the speculative config may give the method."""
        return (self.name, *self.aliases)

    @property
    def external(self):
        """True for a draft of its own checkpoint in vime's external-draft format."""
        return self.format is not None

    @property
    def wire_prefix(self):
        """An external draft's tensors travel to the rollout as `<name>.<checkpoint name>`."""
        return f"{self.name}." if self.external else None

    @property
    def needs_model(self):
        """What the speculative config's "model" must be (None: the kind reads no checkpoint of its own)."""
        if self.external:
            return (f'"model": "/path/to/{self.name}/draft" (make one with '
                    f"`python {self.format.make} --target CKPT --out DIR`)")
        return self.model

    # ---- an external draft's checkpoint (vime/models/draft_format.py) ----
    def read_config(self, path):
        """The draft's model config from its directory; one line when it is not this kind's draft."""
        return draft_format.read_config(self, path)

    def check_directory(self, path, target_cfg, num_speculative_tokens=None):
        """The draft directory fits the target (config and tensors, nothing loaded); returns its config."""
        return draft_format.check_directory(self, path, target_cfg, num_speculative_tokens)

    def check_fits(self, path, cfg, target_cfg, num_speculative_tokens=None, tensors=None):
        """The draft of config `cfg` (its tensors at `path`, or `tensors` {name: shape}) fits the target."""
        draft_format.check_fits(self, path, cfg, target_cfg, num_speculative_tokens, tensors)

    def load(self, path):
        """(model config, {checkpoint name: tensor}) of a draft directory."""
        return draft_format.load(self, path)

    def load_for_target(self, path, target_cfg, num_speculative_tokens=None):
        """The draft module of a directory, its fit to the target checked before any tensor is read."""
        return draft_format.load_for_target(self, path, target_cfg, num_speculative_tokens)

    def save(self, path, cfg, state):
        """Write a draft directory vLLM serves unchanged (its tensors checked against `cfg` first)."""
        draft_format.save(self, path, cfg, state)
