"""Offline warm-up of a draft on its target's own sequences (pure torch).

Every draft kind starts from a short offline fit before RL: batches of the target's samples, the frozen
target's hidden states, the kind's own loss. The target does not train, so its states are computed once per
sequence and every step reads them back (causal attention: a sequence's states do not depend on the batch
or the padding after it). The loop is the same for every external kind (EAGLE-3, DFlash, DSpark); the kind
brings only its loss. Fresh MTP layers (mtp/fresh_layers.py) share the batching, the states and the fit:
AdamW on random batches, stopped where the loss on held-out samples of the target stops falling.
"""
import math
import random
import time

import torch


def padded_tokens(sequences, rows):
    """The chosen rows' tokens [B, T], zero-padded at the end."""
    tokens = torch.zeros(len(rows), max(len(sequences[i]) for i in rows), dtype=torch.long)
    for r, i in enumerate(rows):
        tokens[r, :len(sequences[i])] = torch.tensor(sequences[i])
    return tokens


def states_per_sequence(sequences, batch_size, states_of):
    """[states_of(tokens [b, T], positions [b, T])[r, :len_i] for sequence i], computed without gradients in
    batches of `batch_size` sequences (states_of: the frozen target's states of a batch, [b, T, ...])."""
    states = []
    for first in range(0, len(sequences), batch_size):
        rows = list(range(first, min(first + batch_size, len(sequences))))
        tokens = padded_tokens(sequences, rows)
        with torch.no_grad():
            batch = states_of(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))
        states += [batch[r, :len(sequences[i])] for r, i in enumerate(rows)]
    return states


def padded_states(states, rows, width):
    """The chosen rows' states (of `states_per_sequence`) zero-padded to [B, width, ...]."""
    out = torch.zeros(len(rows), width, *states[0].shape[1:], dtype=states[0].dtype)
    for r, i in enumerate(rows):
        out[r, :len(states[i])] = states[i]
    return out


HELD_OUT_EVERY = 8  # one sequence in this many is kept out of the warm-up's training, to read its held-out loss
EVAL_EVERY = 25  # steps between two reads of the held-out loss
PATIENCE = 2  # reads without a new lowest held-out loss after which the warm-up stops


def split_held_out(n, held_out=True):
    """(training rows, held-out rows) of n sequences: every HELD_OUT_EVERY-th is held out, none when
    `held_out` is off or too few sequences leave both sides at least one."""
    held = list(range(HELD_OUT_EVERY - 1, n, HELD_OUT_EVERY)) if held_out and n >= 2 * HELD_OUT_EVERY else []
    kept_out = set(held)
    return [i for i in range(n) if i not in kept_out], held


class BestParameters:
    """The parameters at the lowest held-out loss read so far, and how many reads since it fell."""

    def __init__(self, params):
        self.params, self.loss, self.step, self.stale, self.saved = params, math.inf, None, 0, None

    def offer(self, loss, step):
        if loss < self.loss:
            self.loss, self.step, self.stale = loss, step, 0
            self.saved = [p.detach().clone() for p in self.params]
        else:
            self.stale += 1

    def restore(self):
        if self.saved is not None:
            with torch.no_grad():
                for p, kept in zip(self.params, self.saved):
                    p.copy_(kept)


def held_out_loss(batch_loss, rows, batch_size):
    """The mean over `rows`, in batches of `batch_size`, of batch_loss's loss, each batch weighted by its rows."""
    total = 0.0
    with torch.no_grad():
        for first in range(0, len(rows), batch_size):
            chunk = rows[first:first + batch_size]
            total += batch_loss(chunk)[0].item() * len(chunk)
    return total / len(rows)


def fit_on_sequences(params, n_sequences, batch_loss, steps, batch_size, lr, seed, per_what, log=print,
                     held_out=True, name="warm-up"):
    """Up to `steps` AdamW steps of `params` on random batches of the training rows of n_sequences sequences;
    returns how many steps the kept parameters took.

    batch_loss(rows): (loss, per-position losses) of the chosen sequences; `per_what` names those positions in
    the log. With `held_out`, one sequence in HELD_OUT_EVERY is not trained on: every EVAL_EVERY steps the loss
    on them is read, the parameters at its lowest are the ones kept, and the fit stops after PATIENCE reads
    without a new lowest. A warm-up draws a few hundred samples and takes many batches of them, so past some
    step the draft learns those samples rather than the target, and its loss on the target's other text
    (what RL drafts) rises."""
    train, held = split_held_out(n_sequences, held_out)
    rng, start = random.Random(seed), time.time()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    best = BestParameters(params)
    for step in range(steps):
        rows = [train[rng.randrange(len(train))] for _ in range(batch_size)]
        loss, per_position = batch_loss(rows)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        last = step == steps - 1
        if step % 50 == 0 or last:
            log(f"{name} step {step:4d}  loss by {per_what} " + " ".join(f"{x.item():.3f}" for x in per_position)
                + f"  {time.time() - start:.0f}s")
        if held and ((step + 1) % EVAL_EVERY == 0 or last):
            best.offer(held_out_loss(batch_loss, held, batch_size), step)
            if best.stale >= PATIENCE:
                log(f"{name} stops at step {step}: the held-out loss last fell at step {best.step}")
                break
    if not held:
        return steps
    best.restore()
    log(f"{name} keeps step {best.step} (held-out loss {best.loss:.3f} on {len(held)} sequences)")
    return best.step + 1


def warm_up_draft(draft, target, sequences, steps, batch_size, lr, seed, loss_of, per_what, log=print, held_out=True,
                  masks=None):
    """Up to `steps` AdamW steps of `draft` on random batches of `sequences` (fit_on_sequences: returns the steps
    kept).

    loss_of(tokens, mask, aux): (loss, per-position losses) of the kind, where aux are the target's
    detached hidden states at the draft's aux layers and mask marks the tokens the loss may predict:
    `masks[i]` of sequence i (e.g. its response), by default all of its tokens."""
    aux_states = states_per_sequence(
        sequences, batch_size, lambda tokens, positions: target.aux_hidden_states(tokens, positions,
                                                                                  draft.cfg.aux_layer_ids))
    mask_rows = [torch.tensor(m, dtype=torch.float32) for m in masks or [[1] * len(s) for s in sequences]]

    def batch_loss(rows):
        tokens = padded_tokens(sequences, rows)
        return loss_of(tokens, padded_states(mask_rows, rows, tokens.shape[1]),
                       padded_states(aux_states, rows, tokens.shape[1]))

    return fit_on_sequences(list(draft.parameters()), len(sequences), batch_loss, steps, batch_size, lr, seed,
                            per_what, log, held_out)
