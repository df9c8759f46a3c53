"""The table of draft kinds (pure): one `DraftKind` line per speculative method vime drafts with.

Every table keyed by kind is derived from this one: the speculative config's method names, block
methods and drafts that need a `model` (vime/spec_config.py), the proposer registry
(rollout/embedded/proposers), the draft-trainer registry (trainer/drafts) and its knobs' defaults
(restated in --help), the wire prefixes of external drafts' tensors and their vLLM names
(vime/models/vllm_names.py), the export of a trained draft (scripts/export_draft.py). An external
kind's descriptor lives beside its format (vime/models/<kind>.py); the kinds that read no checkpoint
of their own are declared here.
"""
from vime.models.dflash import DFLASH
from vime.models.draft_kind import DraftKind, DraftKnobs
from vime.models.dspark import DSPARK
from vime.models.eagle3 import EAGLE3
from vime.models.families import is_mtp_name

MTP = DraftKind(
    name="mtp", title="MTP layers", proposer="MTPProposer", aliases=("deepseek_mtp", "mimo_mtp", "glm4_moe_mtp"),
    trainer="MTPDraftTrainer",
    # layers inside the policy, stepped once beside each policy step; Adam with a larger lr than the
    # policy's moves a detached draft as fast as the loss factor alone would not
    knobs=DraftKnobs(lr=5e-3, steps_per_rollout=1, replay_batches=0))
NGRAM = DraftKind(name="ngram", title="n-gram lookup", proposer="NgramProposer")
SUFFIX = DraftKind(name="suffix", title="suffix decoding", proposer="SuffixProposer")
DRAFT_MODEL = DraftKind(name="draft_model", title="draft model", proposer="DraftModelProposer",
                        model='"model": "/path/to/draft/hf/checkpoint"')

DRAFT_KINDS = {kind.name: kind for kind in (MTP, NGRAM, SUFFIX, DRAFT_MODEL, EAGLE3, DFLASH, DSPARK)}

# the speculative config's method under every name vLLM gives it -> the kind
METHOD_ALIASES = {alias: kind.name for kind in DRAFT_KINDS.values() for alias in kind.names}
EXTERNAL_KINDS = tuple(kind for kind in DRAFT_KINDS.values() if kind.external)
EXTERNAL_DRAFT_PREFIXES = tuple(kind.wire_prefix for kind in EXTERNAL_KINDS)
# the loss terms some kind weighs (--draft-<term>-weight)
LOSS_TERMS = tuple(dict.fromkeys(term for kind in DRAFT_KINDS.values() for term, _ in kind.loss_weights))


def external_kind(method):
    """The external draft kind of a speculative method (None: not an external draft)."""
    kind = DRAFT_KINDS.get(method)
    return kind if kind is not None and kind.external else None


def external_draft_prefix(name):
    """The wire prefix of an external draft's tensor `name` (e.g. "dflash."), or None."""
    return next((p for p in EXTERNAL_DRAFT_PREFIXES if name.startswith(p)), None)


def kind_of_wire_prefix(prefix):
    """The external kind whose tensors travel under `prefix`."""
    return next(kind for kind in EXTERNAL_KINDS if kind.wire_prefix == prefix)


def is_draft_name(name, num_hidden_layers):
    """True for a tensor of the draft: an MTP layer's, or an external draft's (`EXTERNAL_DRAFT_PREFIXES`)."""
    return external_draft_prefix(name) is not None or is_mtp_name(name, num_hidden_layers)


def trained_kinds():
    """The kinds a run can train online, in table order."""
    return tuple(kind for kind in DRAFT_KINDS.values() if kind.trainer is not None)
