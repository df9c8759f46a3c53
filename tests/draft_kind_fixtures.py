"""What the tests of every external draft kind share: the shipped Qwen2 target and each kind's shipped
draft (`checkpoints/tiny-qwen2-<kind>`), a copy of a draft edited, a random draft of a kind for any target,
the 5-token target and draft pair of the distribution tests, and each kind's cache-free reference of greedy
acceptance.

A kind's own test fixtures (its reference computation) stay in `<kind>_fixtures.py`; this file names
each kind once, in its tables (a new kind adds a line to each).
"""
import dataclasses
import json
import os
import shutil

import torch

from vime.models import dflash, dspark, eagle3
from vime.models.draft_kinds import EXTERNAL_KINDS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(REPO, "checkpoints", "tiny-qwen2")


def shipped_draft(kind):
    """The kind's draft shipped for the tiny Qwen2 target."""
    return os.path.join(REPO, "checkpoints", f"tiny-qwen2-{kind.name}")


def edited_draft(tmp_path, kind, config=None, tensors=None, source=None):
    """A copy of a draft of `kind` (`source`, default its shipped one) with config.json edited by `config(raw)`
    and model.safetensors by `tensors(state)`, in place."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / f"{kind.name}-edited"
    shutil.copytree(source or shipped_draft(kind), out)
    if config:
        raw = json.loads((out / "config.json").read_text())
        config(raw)
        (out / "config.json").write_text(json.dumps(raw))
    if tensors:
        state = load_file(out / "model.safetensors")
        tensors(state)
        save_file(state, out / "model.safetensors")
    return out


def shipped_k(kind):
    """The drafts per step the shipped draft serves (a block draft: its block's drafts)."""
    return kind.read_config(shipped_draft(kind)).num_drafts if kind.block else 3


def shipped_spec(kind, **extra):
    return {"method": kind.name, "model": shipped_draft(kind), "num_speculative_tokens": shipped_k(kind), **extra}


# kind -> the config of a new draft for a target (ModelConfig) drafting k tokens, reading `layers`
# (the kind's own numbering of the target layers it reads; None: its default)
NEW_DRAFT_CONFIGS = {
    "eagle3": lambda target_cfg, k, layers: eagle3.draft_config_for_target(target_cfg, aux_layer_ids=layers),
    "dflash": lambda target_cfg, k, layers: dflash.draft_config_for_target(target_cfg, num_layers=1, block_size=k + 1,
                                                                           target_layer_ids=layers),
    "dspark": lambda target_cfg, k, layers: dspark.draft_config_for_target(
        target_cfg, num_layers=1, block_size=k, markov_rank=8, confidence_head_with_markov=True,
        target_layer_ids=layers),
}
# kind -> the layers its draft reads on a 2-layer target (the distribution tests' and the trainer tests')
SMALL_TARGET_LAYERS = {"eagle3": (0, 1, 2), "dflash": (0, 1), "dspark": (0, 1)}


def random_draft(kind, target_cfg, seed, std, k=2, layers=None, cfg=None):
    """A random draft of `kind` for `target_cfg` (of config `cfg`, default the kind's new one): its weights
    normal(std), its norm scales perturbed by as much (so that each norm matters)."""
    torch.manual_seed(seed)
    draft = kind.format.model(cfg or NEW_DRAFT_CONFIGS[kind.name](target_cfg, k, layers))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, std) if p.dim() == 2 else p.add_(torch.randn(p.shape) * std)
    return draft.eval().requires_grad_(False)


def vocab_pair(kind, k=2):
    """A 5-token Qwen2 target without MTP layers (the embedded engine's model) and a random draft of
    `kind` on its first layers, drafting k tokens: acceptance well inside (0.1, 0.9)."""
    from rollout.embedded.model import CausalLMWithMTP
    from spec_fixtures import tiny_vocab_model

    target = tiny_vocab_model(seed=1, family="qwen2", tie_word_embeddings=False)
    cfg = dataclasses.replace(target.cfg, num_nextn_predict_layers=0, pad_token_id=4)
    keep = {n: p for n, p in target.state_dict().items() if not n.startswith(f"model.layers.{cfg.num_hidden_layers}.")}
    model = CausalLMWithMTP(cfg)
    model.load_state_dict(keep)
    return model.eval(), random_draft(kind, cfg, seed=3, std=0.35, k=k, layers=SMALL_TARGET_LAYERS[kind.name])


def _eagle3_acceptance(draft_dir, state):
    from eagle3_fixtures import reference_acceptance
    from rollout.embedded.engine_builder import build_engine
    from vime.models.hf_format import read_config

    target = build_engine(TARGET, None).model  # the target as the embedded engine computes it
    cfg, saved = eagle3.EAGLE3.load(draft_dir)
    draft = eagle3.EAGLE3.format.model(eagle3.resolve_aux_layers(cfg, read_config(TARGET)))
    draft.load_state_dict(saved if state is None else state)
    k = shipped_k(eagle3.EAGLE3)
    return lambda prompt, response, max_new, past_end=False: reference_acceptance(target, draft.eval(), prompt,
                                                                                   response, k, max_new, past_end)


def _dflash_acceptance(draft_dir, state):
    from dflash_fixtures import load_reference, reference_acceptance

    target, saved, cfg = load_reference(draft_dir)
    reference = (target, saved if state is None else state, cfg)
    return lambda prompt, response, max_new, past_end=False: reference_acceptance(reference, prompt, response,
                                                                                   max_new, past_end)


def _dspark_acceptance(draft_dir, state):
    from dspark_fixtures import load_reference, reference_acceptance

    target, saved, cfg = load_reference(draft_dir)
    reference = (target, saved if state is None else state, cfg)
    return lambda prompt, response, max_new, past_end=False: reference_acceptance(reference, prompt, response,
                                                                                   max_new, past_end)


def _eagle3_warm_up_loss(draft, target, k):
    from mtp.eagle3 import training_time_test_loss

    embed = target.model.embed_tokens.weight.detach()
    return lambda tokens, mask, aux: training_time_test_loss(draft, torch.nn.functional.embedding(tokens, embed), aux,
                                                             tokens, mask, k)


def _dflash_warm_up_loss(draft, target, k):
    from mtp.dflash import block_loss

    embed, head, anchors = target.model.embed_tokens.weight.detach(), target.head_weight().detach(), torch.Generator()
    return lambda tokens, mask, aux: block_loss(draft, aux, tokens, mask, embed, head, 16, generator=anchors)


def _dspark_warm_up_loss(draft, target, k):
    from mtp.dspark import dspark_loss

    embed, head, anchors = target.model.embed_tokens.weight.detach(), target.head_weight().detach(), torch.Generator()

    def loss_of(tokens, mask, aux):
        with torch.no_grad():
            logits = target.logits(target(tokens, torch.arange(tokens.shape[1]).expand_as(tokens)))
        return dspark_loss(draft, aux, tokens, mask, embed, head, 16, logits, generator=anchors)[:2]
    return loss_of


# kind -> its offline loss (as its scripts/make_<kind>_draft.py warms it up): (draft, target model, k) ->
# loss_of(tokens, mask, aux) of mtp/draft_warmup.py
WARM_UP_LOSSES = {"eagle3": _eagle3_warm_up_loss, "dflash": _dflash_warm_up_loss, "dspark": _dspark_warm_up_loss}


def warmed_up_draft(kind, target, sequences, k, steps=25, seed=0):
    """A draft of `kind` for the embedded engine's model `target`, fitted for `steps` AdamW steps to
    `sequences` (token lists the target generated): one that the target accepts on them."""
    from mtp.draft_warmup import warm_up_draft

    draft = random_draft(kind, target.cfg, seed, std=0.02, k=k).train().requires_grad_(True)
    warm_up_draft(draft, target, sequences, steps, len(sequences), 3e-3, seed, WARM_UP_LOSSES[kind.name](draft, target, k),
                  "position", log=lambda line: None, held_out=False)
    return draft.eval().requires_grad_(False)


# kind -> its cache-free reference of greedy acceptance (its <kind>_fixtures.py)
ACCEPTANCE_REFERENCES = {"eagle3": _eagle3_acceptance, "dflash": _dflash_acceptance, "dspark": _dspark_acceptance}


def acceptance_reference(kind, draft_dir, state=None):
    """(prompt, response, max_new, past_end=False) -> (drafted, accepted) per draft position of greedy
    speculative decoding of `response` with the kind's draft in `draft_dir` (its tensors `state` if
    given), every draft recomputed from scratch; `past_end` counts as vLLM does (see <kind>_fixtures.py)."""
    return ACCEPTANCE_REFERENCES[kind.name](draft_dir, state)


assert set(NEW_DRAFT_CONFIGS) == set(SMALL_TARGET_LAYERS) == set(WARM_UP_LOSSES) == set(ACCEPTANCE_REFERENCES) == \
    {k.name for k in EXTERNAL_KINDS}
