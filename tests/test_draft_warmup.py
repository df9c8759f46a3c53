"""The warm-ups' frozen target states (mtp/draft_warmup.py): computed once, in zero-padded batches, each
sequence's states are the ones transformers computes for that sequence alone."""
import torch

from fp32_bounds import forward_depth, longest_reduction, reduction_rtol
from llama_fixtures import make_llama
from mtp.draft_warmup import padded_states, padded_tokens, states_per_sequence
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
