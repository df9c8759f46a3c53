"""An `Engine` with its proposer, assembled from a speculative config (`SpecConfig`).

This sits above both the engine and the proposers (a proposer reads the spec config; the
engine runs any proposer), so neither of them imports the other's configuration.
"""
import dataclasses

from rollout.embedded.engine import Engine, EngineConfig
from rollout.embedded.proposers import PROPOSERS
from rollout.embedded.spec_policy import build_k_policy
from vime.errors import require
from vime.models.hf_format import read_config
from vime.spec_config import FLAG, as_spec_config, check_against_checkpoint, check_spec_adaptive, \
    synthetic_position_rates


def build_proposer(spec):
    """A proposer for `spec` (None: plain decoding) from the registry."""
    return PROPOSERS["none" if spec is None else spec.method](spec)


def build_engine(checkpoint, spec=None, engine_config=None, adaptive=False):
    """An Engine on `checkpoint` with speculation per `spec` (SpecConfig, JSON string, mapping or None);
    `adaptive` is vime's --spec-adaptive (k per batch size from a start-up cost profile and the measured acceptance)."""
    spec = as_spec_config(spec)
    check_spec_adaptive(spec, adaptive)
    check_against_checkpoint(spec, read_config(checkpoint))
    config = engine_config_for(spec, engine_config or EngineConfig())
    engine = Engine.from_checkpoint(checkpoint, config, build_proposer(spec))
    engine.k_policy = build_k_policy(spec, adaptive, config.max_batch_size)
    engine.k_policy.prepare(engine)  # the adaptive cost profile, here rather than inside the first generate
    return engine


def engine_config_for(spec, engine_config):
    """The engine's slice of the spec config: how drafts are verified."""
    if spec is None:
        return engine_config
    return dataclasses.replace(engine_config, rejection_sample_method=spec.rejection_sample_method,
                               synthetic_acceptance_rates=synthetic_position_rates(spec))


def check_config(cfg, hf):
    """The embedded engine's own pre-start checks of a run's config (rollout/backend.py BACKEND_CHECKS):
    the speculative config against the target checkpoint `hf`, and drafts per verify step within its
    context."""
    r = cfg.rollout
    spec = r.vllm_speculative_config
    check_against_checkpoint(spec, hf)
    if spec is not None:
        room = hf.max_position_embeddings - 2
        require(spec.num_speculative_tokens <= room,
                f"{FLAG}: num_speculative_tokens {spec.num_speculative_tokens} exceeds the model's context "
                f"({hf.max_position_embeddings} positions); use at most {min(room, r.rollout_max_response_len)}")
