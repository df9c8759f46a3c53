"""The warm-ups (mtp/draft_warmup.py): the frozen target states, computed once in zero-padded batches, are each
sequence's own as transformers computes it alone; the fit never trains on its held-out sequences, keeps the
parameters where their loss was lowest and stops once it rises (reference: the same AdamW steps run directly,
and the fit without a held-out set as the negative control)."""
import torch

from fp32_bounds import forward_depth, longest_reduction, reduction_rtol
from llama_fixtures import make_llama
from mtp.draft_warmup import (EVAL_EVERY, HELD_OUT_EVERY, PATIENCE, fit_on_sequences, padded_states, padded_tokens,
                               split_held_out, states_per_sequence)
from vime.models.hf_format import read_config

SEQUENCES = [[1, 5, 6, 7, 3], [1, 8], [1, 9, 10, 11, 12, 13, 14], [1, 4, 4], [1, 20, 21]]


def test_states_from_padded_batches_are_each_sequences_own(tmp_path):
    model = make_llama(tmp_path)

    def last_hidden(tokens, positions):
        return model(input_ids=tokens, position_ids=positions, output_hidden_states=True).hidden_states[-1]

    got = states_per_sequence(SEQUENCES, 3, last_hidden)
    cfg = read_config(str(tmp_path))
    rtol = reduction_rtol(longest_reduction(cfg, max(map(len, SEQUENCES))), forward_depth(cfg.num_hidden_layers))
    for sequence, states in zip(SEQUENCES, got):
        with torch.no_grad():
            alone = last_hidden(torch.tensor([sequence]), torch.arange(len(sequence))[None])[0]
        assert states.shape == alone.shape and not states.requires_grad
        assert (states - alone).abs().max() <= rtol * alone.abs().max()


def test_a_batch_reads_back_the_chosen_rows_zero_padded():
    states = [torch.full((len(s), 2), float(i + 1)) for i, s in enumerate(SEQUENCES)]
    rows = [2, 1, 2]
    tokens, batch = padded_tokens(SEQUENCES, rows), padded_states(states, rows, 7)
    assert tokens.tolist()[1] == [1, 8, 0, 0, 0, 0, 0] and tokens.tolist()[0] == SEQUENCES[2]
    assert batch[1, :2].eq(2).all() and batch[1, 2:].eq(0).all() and batch[0].eq(3).all()


def test_one_sequence_in_held_out_every_is_held_out_when_both_sides_keep_some():
    train, held = split_held_out(5 * HELD_OUT_EVERY)
    assert held == [i for i in range(5 * HELD_OUT_EVERY) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    assert sorted(train + held) == list(range(5 * HELD_OUT_EVERY))
    assert split_held_out(2 * HELD_OUT_EVERY - 1) == (list(range(2 * HELD_OUT_EVERY - 1)), [])
    assert split_held_out(64, held_out=False) == (list(range(64)), [])


LR, TRAIN_TARGET, HELD_TARGET = 0.01, 2.0, 1.0  # Adam moves w by about LR a step: past 1.0 after ~100 steps


def overfitting_problem(n):
    """A scalar w from 0, a squared loss towards 2 on training rows and towards 1 on held-out ones: the held-out
    loss falls, then rises as w passes 1 (a draft learning its samples, not the target)."""
    w = torch.zeros(1, requires_grad=True)
    _, held = split_held_out(n)
    trained_rows = []

    def batch_loss(rows):
        targets = torch.tensor([HELD_TARGET if i in held else TRAIN_TARGET for i in rows])
        if torch.is_grad_enabled():
            trained_rows.extend(rows)
        loss = ((w - targets) ** 2).mean()
        return loss, [loss]
    return w, held, batch_loss, trained_rows


def direct_adamw(steps):
    """w after `steps` steps of the fit's optimiser (AdamW, clip 1.0) on the training rows' loss, run directly."""
    w = torch.zeros(1, requires_grad=True)
    opt = torch.optim.AdamW([w], lr=LR, weight_decay=0.0)
    for _ in range(steps):
        loss = ((w - TRAIN_TARGET) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([w], 1.0)
        opt.step()
    return w.detach()


def test_the_fit_keeps_the_lowest_held_out_loss_and_stops_after_it():
    n, lines = 4 * HELD_OUT_EVERY, []
    w, held, batch_loss, trained_rows = overfitting_problem(n)
    kept = fit_on_sequences([w], n, batch_loss, 400, 4, LR, 0, "w", log=lines.append)
    assert held and not set(trained_rows) & set(held)
    # the reads fall on steps EVAL_EVERY - 1, 2 * EVAL_EVERY - 1, ...: the kept one is the read w closest to 1
    reads = [direct_adamw(s).item() for s in range(EVAL_EVERY, 401, EVAL_EVERY)]
    best = min(range(len(reads)), key=lambda i: abs(reads[i] - HELD_TARGET))
    kept_step, stop_step = (best + 1) * EVAL_EVERY - 1, (best + 1 + PATIENCE) * EVAL_EVERY - 1
    assert 0 < best < len(reads) - PATIENCE  # the problem brackets its optimum
    assert kept == kept_step + 1 and torch.allclose(w.detach(), direct_adamw(kept), rtol=0, atol=1e-6)
    assert f"stops at step {stop_step}" in "\n".join(lines) and f"keeps step {kept_step}" in lines[-1]
    # negative control: without a held-out set every step trains, towards the training rows' target
    w, _, batch_loss, trained_rows = overfitting_problem(n)
    assert fit_on_sequences([w], n, batch_loss, 400, 4, LR, 0, "w", log=lambda line: None, held_out=False) == 400
    assert set(trained_rows) == set(range(n)) and abs(w.item() - HELD_TARGET) > abs(reads[best] - HELD_TARGET)
