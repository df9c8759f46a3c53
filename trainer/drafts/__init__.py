"""Drafts trained online beside the policy: one file per kind behind one interface (base.py).

`DRAFT_TRAINERS` maps a kind to its trainer: `mtp` (the policy's own MTP layers,
--enable-mtp-training) and the external drafts of the speculative config, by its `method`
(--enable-draft-training). Adding a kind is a file and a line here.
"""
from trainer.drafts.base import DRAFT_STATE_FILE, DraftTrainer, load_draft_state, save_draft_state, saved_draft_state_file
from trainer.drafts.dflash import DFlashDraftTrainer
from trainer.drafts.dspark import DSparkDraftTrainer
from trainer.drafts.eagle3 import Eagle3DraftTrainer
from trainer.drafts.mtp import MTPDraftTrainer
from vime.errors import require

DRAFT_TRAINERS = {"mtp": MTPDraftTrainer, "eagle3": Eagle3DraftTrainer, "dflash": DFlashDraftTrainer,
                  "dspark": DSparkDraftTrainer}
EXTERNAL_EXAMPLE = '\'{"method":"eagle3","model":DRAFT_DIR,"num_speculative_tokens":3}\''

__all__ = ["DRAFT_STATE_FILE", "DRAFT_TRAINERS", "DraftTrainer", "build_draft", "check_draft_config", "draft_kind",
           "load_draft_state", "save_draft_state", "saved_draft_state_file"]


def draft_kind(cfg):
    """The kind of draft a TrainerConfig trains (None: none): `mtp` for --enable-mtp-training, the
    speculative config's method for --enable-draft-training (an external draft)."""
    require(not (cfg.enable_mtp_training and cfg.enable_draft_training),
            "--enable-mtp-training and --enable-draft-training each train the run's one draft: keep the one "
            "that --vllm-speculative-config drafts with")
    if cfg.enable_mtp_training:
        return "mtp"
    if not cfg.enable_draft_training:
        return None
    spec = cfg.speculative_config
    method = spec.method if spec is not None else None
    require(method != "mtp", "--enable-draft-training trains an external draft, but method 'mtp' drafts with the "
            "policy's own MTP layers: train those with --enable-mtp-training --mtp-num-layers N")
    external = sorted(k for k in DRAFT_TRAINERS if k != "mtp")
    require(method in DRAFT_TRAINERS,
            f"--enable-draft-training trains an external draft ({', '.join(external)}): give --vllm-speculative-config "
            f"{EXTERNAL_EXAMPLE} (got {'no speculation' if spec is None else 'method ' + repr(method)})")
    return method


def check_draft_config(cfg):
    """A TrainerConfig's draft flags, checked before a run's trainers start: the kind, then its knobs and
    their bounds."""
    kind = draft_kind(cfg)
    if kind is not None:
        DRAFT_TRAINERS[kind].check_bounds(cfg, DRAFT_TRAINERS[kind].checked_knobs(cfg))


def build_draft(cfg, model, model_cfg):
    """The draft the run trains beside the policy `model` (of ModelConfig `model_cfg`), or None."""
    kind = draft_kind(cfg)
    return None if kind is None else DRAFT_TRAINERS[kind](cfg, model, model_cfg)
