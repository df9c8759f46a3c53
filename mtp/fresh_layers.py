"""Fresh MTP layers for a model that has none, initialised as megatron-core initialises them, and their offline
warm-up on the model's own sequences (pure torch).

megatron-core 0.16.1 (`TransformerConfig.__post_init__`, `MultiTokenPredictionLayer`) draws every linear of an MTP
layer from normal(0, init_method_std = 0.02) (`init_method`: eh_proj, the fused q/k/v, the MLP's gate/up), except
the two that write into the residual stream, the attention's output projection and the MLP's down projection,
drawn from normal(0, 0.02 / sqrt(2 * num_layers)) with num_layers the trunk's (`output_layer_init_method`,
`scaled_init_method_normal`); every RMSNorm weight starts at 1. `fresh_mtp_state` draws the same distributions
under vime's canonical names. The warm-up trains only those layers (the trunk, embedding and head frozen) with
the MTP loss of mtp/loss.py on sequences the model generated itself, so that RL starts from a draft the policy
already accepts.
"""
import dataclasses
import math

import torch

from mtp.draft_warmup import fit_on_sequences, padded_states, padded_tokens, states_per_sequence
from mtp.loss import mtp_ce_at_trained_positions

INIT_METHOD_STD = 0.02  # megatron-core's TransformerConfig.init_method_std default
# canonical suffixes megatron initialises with output_layer_init_method (they write into the residual stream)
OUTPUT_LAYER_SUFFIXES = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def init_std(suffix, num_hidden_layers, std=INIT_METHOD_STD):
    """The normal std megatron-core draws an MTP layer's matrix `suffix` from (None: a norm weight, set to 1)."""
    if suffix.endswith("norm.weight"):
        return None
    if suffix in OUTPUT_LAYER_SUFFIXES:
        return std / math.sqrt(2.0 * num_hidden_layers)
    return std


def fresh_mtp_state(cfg, num_mtp_layers, expected, seed=0):
    """{canonical name: tensor} of `num_mtp_layers` new MTP layers of `cfg` (a ModelConfig without MTP layers).
    `expected`: {canonical name: shape} of every tensor of the model with those layers (hf_format's
    `expected_hf_tensors`), whose MTP entries this fills."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    first = f"model.layers.{cfg.num_hidden_layers}."
    for name, shape in sorted(expected.items()):
        index = name.split(".")[2] if name.startswith("model.layers.") else None
        if index is None or int(index) < cfg.num_hidden_layers:
            continue
        suffix = name.split(".", 3)[3]
        std = init_std(suffix, cfg.num_hidden_layers)
        out[name] = torch.ones(shape) if std is None else torch.randn(shape, generator=g) * std
    assert any(n.startswith(first) for n in out) or num_mtp_layers == 0
    return out


def with_mtp_layers(cfg, num_mtp_layers):
    """`cfg` (a ModelConfig) declaring `num_mtp_layers` MTP layers."""
    return dataclasses.replace(cfg, num_nextn_predict_layers=num_mtp_layers)


def mtp_parameters(model):
    """The MTP layers' parameters of a CausalLMWithMTP (the only ones the warm-up trains)."""
    return [p for k in range(model.num_mtp_layers) for p in model.mtp_layer(k).parameters()]


def warm_up_mtp_layers(model, sequences, masks, steps, batch_size, lr, seed, log=print, held_out=True):
    """Up to `steps` AdamW steps of the MTP layers of `model` (a CausalLMWithMTP) on random batches of
    `sequences` (token lists; mtp/draft_warmup.py's fit_on_sequences, held-out stop included); `masks[i]` marks
    the tokens of sequence i the loss may read and predict (its response). Each depth k reads the previous
    depth's output, as the engine drafts; the loss is the token mean of every depth's cross-entropy. The trunk
    is frozen: its hidden states are computed once per sequence. Returns the steps the kept layers took."""
    model.requires_grad_(False)
    params = mtp_parameters(model)
    for p in params:
        p.requires_grad_(True)
    states = states_per_sequence(sequences, batch_size, lambda tokens, positions: model.forward_states(
        tokens, positions)[1])
    mask_rows = [torch.tensor(m, dtype=torch.float32) for m in masks]

    def batch_loss(rows):
        tokens = padded_tokens(sequences, rows)
        width = tokens.shape[1]
        losses = mtp_depth_losses(model, tokens, padded_states(mask_rows, rows, width),
                                  hidden=padded_states(states, rows, width))
        return sum(losses) / len(losses), losses

    kept = fit_on_sequences(params, len(sequences), batch_loss, steps, batch_size, lr, seed, "depth", log, held_out,
                            name="MTP warm-up")
    model.requires_grad_(False)
    return kept


def mtp_depth_losses(model, tokens, mask, hidden):
    """[depth-k cross-entropy] of every MTP layer of `model` on `tokens` (mask: which tokens count), from the
    trunk's last hidden states `hidden` of `tokens`."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    losses = []
    for k in range(model.num_mtp_layers):
        depth = k + 1
        width = tokens.shape[1] - depth
        hidden = model.mtp_forward(k, tokens[:, depth:], hidden[:, :width], positions[:, :width])
        losses.append(mtp_ce_at_trained_positions(hidden, model.logits, tokens, mask, depth))
    return losses
