"""Drafts trained online beside the policy: one file per kind behind one interface (base.py).

`DRAFT_TRAINERS` maps a kind to its trainer, derived from the table of kinds (vime/models/draft_kinds.py:
each kind trained online names its class of `trainer/drafts/<kind>.py`): `mtp` (the policy's own MTP
layers, --enable-mtp-training) and the external drafts of the speculative config, by its `method`
(--enable-draft-training).
"""
import importlib

from trainer.drafts.base import (DRAFT_STATE_FILE, DraftTrainer, load_draft_state, read_draft_state, save_draft_state,
                                 saved_draft_state_file)
from vime.errors import require
from vime.models.draft_kinds import MTP, trained_kinds

DRAFT_TRAINERS = {kind.name: getattr(importlib.import_module(f"trainer.drafts.{kind.name}"), kind.trainer)
                  for kind in trained_kinds()}
EXTERNAL_TRAINED = tuple(name for name in DRAFT_TRAINERS if name != MTP.name)  # external kinds trained online
EXTERNAL_EXAMPLE = f'\'{{"method":"{EXTERNAL_TRAINED[0]}","model":DRAFT_DIR,"num_speculative_tokens":3}}\''

__all__ = ["DRAFT_STATE_FILE", "DRAFT_TRAINERS", "DraftTrainer", "build_draft", "check_draft_config", "check_draft_files", "draft_kind",
           "load_draft_state", "read_draft_state", "save_draft_state", "saved_draft_state_file"]


def draft_kind(cfg):
    """The kind of draft a TrainerConfig trains (None: none): `mtp` for --enable-mtp-training, the
    speculative config's method for --enable-draft-training (an external draft)."""
    require(not (cfg.enable_mtp_training and cfg.enable_draft_training),
            "--enable-mtp-training and --enable-draft-training each train the run's one draft: keep the one "
            "that --vllm-speculative-config drafts with")
    if cfg.enable_mtp_training:
        return MTP.name
    if not cfg.enable_draft_training:
        return None
    spec = cfg.speculative_config
    method = spec.method if spec is not None else None
    require(method != MTP.name, "--enable-draft-training trains an external draft, but method 'mtp' drafts with the "
            "policy's own MTP layers: train those with --enable-mtp-training --mtp-num-layers N")
    require(method in EXTERNAL_TRAINED,
            f"--enable-draft-training trains an external draft ({', '.join(sorted(EXTERNAL_TRAINED))}): give "
            f"--vllm-speculative-config {EXTERNAL_EXAMPLE} (got {'no speculation' if spec is None else 'method ' + repr(method)})")
    return method


def check_draft_config(cfg):
    """A TrainerConfig's draft flags, checked before a run's trainers start: the kind, then its knobs and
    their bounds."""
    kind = draft_kind(cfg)
    if kind is not None:
        DRAFT_TRAINERS[kind].check_bounds(cfg, DRAFT_TRAINERS[kind].checked_knobs(cfg))


def check_draft_training(tree):
    """The draft a run trains (its kind from the flags and the speculative config) and its knobs, from the
    run's config tree."""
    from trainer.config import TrainerConfig

    check_draft_config(TrainerConfig.from_tree(tree))


def check_draft_files(tree):
    """The trained draft's knobs against its own files (a loss weight for a head it has not), from the run's
    config tree; after the draft's directory was checked against the target."""
    from trainer.config import TrainerConfig

    cfg = TrainerConfig.from_tree(tree)
    kind = draft_kind(cfg)
    if kind is not None:
        DRAFT_TRAINERS[kind].check_draft_files(cfg)


def build_draft(cfg, model, model_cfg):
    """The draft the run trains beside the policy `model` (of ModelConfig `model_cfg`), or None."""
    kind = draft_kind(cfg)
    return None if kind is None else DRAFT_TRAINERS[kind](cfg, model, model_cfg)
