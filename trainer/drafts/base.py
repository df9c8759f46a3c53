"""The draft-trainer interface: one kind of draft trained online beside the policy.

The Trainer (trainer/trainer.py) runs one loop for every kind:

1. Beside the policy's step: per micro-batch, the policy's forward; the draft's `inputs` read what it
   needs from that forward (detached, so the policy's loss and gradients are those without a draft),
   `loss` gives the draft's loss, added to the policy's before the one backward. Then the draft's
   `part` (trainer/optimizer.py: megatron's DDP and optimizer over the draft's parameters) reduces its
   gradients over the ranks and steps, clipped by its own grad norm, apart from the policy's.
2. `--draft-steps-per-rollout N`: N-1 steps of the draft alone, on the states of the *updated*
   policy (the one the next rollout drafts for), cycling over this batch and the
   `--draft-replay-batches` previous ones, recomputed with one no-grad forward each.

A kind's descriptor (vime/models/draft_kinds.py) holds its defaults of the shared knobs (used where a
`--draft-*` knob is left unset); its trainer says the names of its metrics, its weights for the push to
the rollout and its checkpoint state.
"""
import abc
import os

import torch
import torch.distributed as dist

from mtp.loss import DISTILLATION_LOSSES
from vime.errors import require
from vime.models.draft_kind import DraftKnobs
from vime.models.draft_kinds import DRAFT_KINDS

DRAFT_STATE_FILE = "draft.pt"  # in a --save checkpoint: a draft's own state (`DraftTrainer.state`)
# what checkpoints held before, still read: file name -> the kind whose state it holds
LEGACY_STATE_FILES = {kind.legacy_state_file: kind.name for kind in DRAFT_KINDS.values() if kind.legacy_state_file}


def resolve_knobs(kind, lr, steps_per_rollout, replay_batches):
    """The shared knobs given (None: the DraftKind `kind`'s default); replay without draft-only steps is refused."""
    defaults = kind.knobs
    knobs = DraftKnobs(lr=defaults.lr if lr is None else lr,
                       steps_per_rollout=defaults.steps_per_rollout if steps_per_rollout is None else steps_per_rollout,
                       replay_batches=defaults.replay_batches if replay_batches is None else replay_batches)
    require(knobs.replay_batches == 0 or knobs.steps_per_rollout > 1,
            f"--draft-replay-batches {knobs.replay_batches} feeds the draft-only steps, but the {kind.name} draft "
            f"takes --draft-steps-per-rollout {knobs.steps_per_rollout}: pass --draft-steps-per-rollout "
            f"{knobs.replay_batches + 2} or more, or --draft-replay-batches 0")
    return knobs


def check_replay_bound(knobs, kind):
    """The replayed batches a run may keep: its steps-1 draft-only steps visit this step's batch and at most
    steps-2 earlier ones, and a batch kept past them costs a forward and its memory every step for nothing."""
    steps, replay = knobs.steps_per_rollout, knobs.replay_batches
    most = max(0, steps - 2)
    require(replay <= most,
            f"--draft-replay-batches {replay}: the {kind.name} draft's --draft-steps-per-rollout {steps} takes "
            f"{steps - 1} draft-only steps, over this step's batch and at most {most} earlier ones (a batch kept past "
            f"them costs a forward and memory and trains nothing): pass --draft-replay-batches {most} or less, or "
            f"--draft-steps-per-rollout {replay + 2} or more")


class DraftTrainer(abc.ABC):
    """One kind of draft trained beside the policy (see module docstring); `trainer/drafts/<kind>.py`."""

    kind = None  # its DraftKind (vime/models/draft_kinds.py): name, defaults of the shared knobs
    metric_prefix = "draft"  # train/<prefix>_<i>_loss, train/<prefix>_loss, train/<prefix>_grad_norm

    # whether the draft's parameters are the megatron model's (the MTP layers): its weights and optimizer state
    # are in the policy's torch_dist checkpoint rather than a file of its own (`state`), and the policy's
    # gradient finalisation makes their TP sums in a joint step (trainer/optimizer.py PolicyPart)
    in_model = False

    def __init__(self, cfg):
        self.cfg = cfg
        self.knobs = self.checked_knobs(cfg)
        self.part = None  # the TrainedPart (trainer/optimizer.py) that reduces and steps the draft's parameters

    @classmethod
    def checked_knobs(cls, cfg):
        """The shared knobs of TrainerConfig `cfg` resolved for this kind, once `check_config` passed."""
        unweighed = [term for term in cfg.draft_loss_weights if term not in dict(cls.kind.loss_weights)]
        weighing = ", ".join(k.title for k in DRAFT_KINDS.values() if k.loss_weights)
        require(not unweighed, f"--draft-{unweighed[0] if unweighed else ''}-weight weighs a loss term of {weighing}; "
                f"the {cls.kind.title} draft trains with --draft-loss-type")
        cls.check_config(cfg)
        return resolve_knobs(cls.kind, cfg.draft_lr, cfg.draft_steps_per_rollout, cfg.draft_replay_batches)

    @classmethod
    def check_config(cls, cfg):
        """Refuse (one line) a TrainerConfig setting this kind cannot honour; run before any trainer starts."""

    @classmethod
    def check_draft_files(cls, cfg):
        """Refuse (one line) a knob that the draft's own files make idle (a head it has not); run with the
        checks that read the run's inputs, once the draft's directory was found a draft of its kind."""

    @classmethod
    def check_bounds(cls, cfg, knobs):
        """Refuse (one line) a knob past the point where it only costs memory and time, given what the run's
        rollout drafts; a run's pre-start check (a Trainer built on its own takes any value it can run)."""
        check_replay_bound(knobs, cls.kind)

    @property
    def reads_policy_logits(self):
        """Whether the loss distils the policy's distribution (then its logits are kept)."""
        return self.cfg.draft_loss_type in DISTILLATION_LOSSES

    # ---- the loss ----------------------------------------------------------------------
    @abc.abstractmethod
    def normaliser(self, batch, num_micro_batches):
        """What each micro-batch's loss divides by so that they sum to the step's loss (per batch)."""

    # whether the loss joins the policy's in the pipeline's backward (the last stage's loss function): it
    # must when it may train jointly with the policy (MTP layers); a draft reading only detached states
    # can run its loss after the pipeline, on states gathered from every stage (`complete`)
    loss_in_pipeline = True

    def after_forward(self):
        """Called on every pipeline stage after each policy forward the draft trains on (keep its states)."""

    @abc.abstractmethod
    def inputs(self, out, mb, normaliser):
        """What the loss reads of one policy forward `out` (trainer/model.py ForwardOutput) over the
        micro-batch `mb`; called on the last pipeline stage right after that forward."""

    def complete(self, inputs):
        """Collective over the pipeline stages, after the forwards of `inputs` (the last stage's list, []
        elsewhere): the inputs with what other stages hold filled in, on the last stage ([] elsewhere)."""
        return inputs

    @abc.abstractmethod
    def loss(self, inputs):
        """(loss to backward, [this micro-batch's share of each part's reported loss]) on `inputs`:
        the parts (depths, drafting steps) sum over micro-batches and data-parallel ranks to the step's."""

    # ---- sync and checkpoints ---------------------------------------------------------
    def named_weights(self):
        """(wire name, tensor) the rollout receives beside the policy's (none: the policy's own carry it)."""
        return iter(())

    def state(self):
        """What a checkpoint keeps of the draft beyond the policy's torch_dist checkpoint (None: nothing)."""
        return None

    def load_state(self, state):
        """Restore what `state` returned."""


def save_draft_state(path, draft):
    """The draft's own state into a --save checkpoint `path` (collective; written by the first rank of the
    last pipeline stage, where a draft trains)."""
    from trainer.distributed import writes_for_last_stage

    state = draft.state()
    if state is not None and writes_for_last_stage():
        torch.save({"kind": draft.kind.name, **state}, os.path.join(path, DRAFT_STATE_FILE))
    dist.barrier()


def saved_draft_state_file(path):
    """The draft-state file of the checkpoint `path` (a model directory), or None when it holds none."""
    for name in (DRAFT_STATE_FILE, *LEGACY_STATE_FILES):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    return None


def read_draft_state(file):
    """A saved draft state (`save_draft_state`'s, or a legacy file's) with its "kind" named."""
    state = torch.load(file, map_location="cpu", weights_only=False)
    state.setdefault("kind", LEGACY_STATE_FILES.get(os.path.basename(file)))  # a legacy file is one kind's
    return state


def load_draft_state(path, draft):
    """What save_draft_state wrote into `path`, into `draft`; one line when it holds none or another kind's."""
    if draft.state() is None:
        return
    file = saved_draft_state_file(path)
    require(file is not None, f"--load {path}: the checkpoint holds no external draft ({DRAFT_STATE_FILE}); "
            "it was saved without --enable-draft-training: resume without it")
    state = read_draft_state(file)
    kind = state.pop("kind")
    require(kind == draft.kind.name, f"--load {path}: the checkpoint's draft is {kind}, this run trains "
            f"{draft.kind.name}: resume with the same --vllm-speculative-config")
    draft.load_state(state)
