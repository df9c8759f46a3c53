"""The engine's chained MTP layers equal megatron-core's MTP block (what the trainer trains).

megatron-core runs MTP layer j at position t on layer j-1's output at t (the trunk's for
j = 0) and the embedding of token t+j+1. The engine's cached catch-up must give the same
logits for every layer at every position it fills from true tokens, across verify steps
(the per-slot carry between rounds included).
"""
import pytest
import torch

from vime.models.families import MTP_FAMILIES
from fp32_bounds import reduction_rtol
from rollout.embedded.engine import Engine, EngineConfig
from vime.sample import samples_for_prompts
from rollout.embedded.proposers.mtp import MTPProposer
from tests.mtp_oracles import mtp_input_hidden
from rollout.sampling_params import SamplingParams
from vime.spec_config import parse_spec_config
from trainer.config import TrainerConfig
from trainer.model import forward
from trainer.trainer import Trainer
from trainer_fixtures import TINY, make_tiny

LAYERS = 2


class RecordingMTP(MTPProposer):
    """Records the logits of every catch-up position: {(prompt index, layer, position): logits}."""

    def __init__(self, spec):
        super().__init__(spec)
        self.seen = {}

    def catch_up(self, slots, out, token_rows):
        runs = super().catch_up(slots, out, token_rows)
        reqs = out.requests
        for j, run in enumerate(runs):
            logits = self.engine.fast.logits(run.out)
            for b, r in enumerate(reqs):
                for i in range(int(run.count[b])):
                    self.seen[(r.sample.index, j, int(run.first[b]) + i)] = logits[b, i].clone()
        return runs


def depth_of_layer(j):
    """Chained fp32 reductions up to MTP layer j's logits: ~10 per decoder layer (norms, q/k/v,
    qk-norm, scores, softmax, weighted sum, o_proj, MLP in and out), 4 per MTP input/output
    (enorm, hnorm, eh_proj, final norm), 1 for the head."""
    return 10 * (TINY["num_hidden_layers"] + j + 1) + 4 * (j + 1) + 1


@pytest.fixture(scope="module", params=sorted(MTP_FAMILIES))
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"mtp_chain_{request.param}")
    # no EOS: every request runs its full budget, so the catch-up spans many verify steps
    make_tiny(path, seed=4, std=0.1, num_nextn_predict_layers=LAYERS, tie_word_embeddings=False, family=request.param,
              eos_token_id=None)
    return str(path)


def test_engine_mtp_logits_of_every_layer_equal_megatron_mtp_block(ckpt):
    proposer = RecordingMTP(parse_spec_config({"method": "mtp", "num_speculative_tokens": 3}))
    engine = Engine.from_checkpoint(ckpt, EngineConfig(max_batch_size=4), proposer=proposer)
    prompts = [[1, 4, 9, 7, 12], [1, 20], [1, 5, 6], [2]]
    samples = engine.generate(samples_for_prompts(prompts), SamplingParams(temperature=0, max_new_tokens=14))
    trainer = Trainer(TrainerConfig(), ckpt)
    trainer.model.eval()
    longest = max(2 * TINY["hidden_size"], TINY["intermediate_size"])  # eh_proj reduces over 2H
    compared = [0] * LAYERS
    for s in samples:
        tokens = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            megatron = trainer.model.mtp_logits(forward(trainer.model, tokens))
        for j in range(LAYERS):
            scale = max(1.0, megatron[j].abs().max().item())
            tol = reduction_rtol(longest, depth_of_layer(j)) * scale
            # megatron's layer j is defined up to S-2-j; the engine stops catching up when a request ends
            for t in range(tokens.shape[1] - j - 1):
                got = proposer.seen.get((s.index, j, t))
                if got is None:
                    continue
                assert (got - megatron[j][0, t]).abs().max().item() <= tol, (s.index, j, t)
                compared[j] += 1
    assert min(compared) > 30  # every layer, across many verify steps


def test_unchained_second_layer_would_differ_from_megatron(ckpt):
    """Negative control: feeding layer 1 the trunk state (the old engine) is far outside the tolerance."""
    engine = Engine.from_checkpoint(ckpt, EngineConfig(max_batch_size=1))
    model = engine.model
    ids = [1, 4, 9, 7, 12, 3, 8, 15, 6]
    tokens, n = torch.tensor([ids]), len(ids)
    trainer = Trainer(TrainerConfig(), ckpt)
    trainer.model.eval()
    with torch.no_grad():
        megatron = trainer.model.mtp_logits(forward(trainer.model, tokens))[1][0, :n - 2]
        trunk = model.forward_states(tokens, torch.arange(n)[None])[1]  # what the first layer reads
        unchained = model.logits(model.mtp_forward(1, tokens[:, 2:], trunk[:, :n - 2], torch.arange(n - 2)[None]))[0]
    tol = reduction_rtol(max(2 * TINY["hidden_size"], TINY["intermediate_size"]), depth_of_layer(1))
    assert (unchained - megatron).abs().max().item() > 100 * tol * max(1.0, megatron.abs().max().item())


@pytest.fixture(scope="module", params=sorted(MTP_FAMILIES))
def one_layer_ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"mtp_repeat_{request.param}")
    make_tiny(path, seed=5, std=0.1, num_nextn_predict_layers=1, tie_word_embeddings=False, family=request.param,
              eos_token_id=None)
    return str(path)


def repeated_layer_logits(model, tokens, depths):
    """Module-path recompute of `--mtp-train-depths --mtp-reuse-attention megatron`: the one MTP layer at depth d reads its own
    depth d-1 output at t (the trunk's for d = 1) and token t+d, no cache."""
    n = tokens.shape[1]
    hidden, logits = mtp_input_hidden(model, tokens), []
    for d in range(depths):
        width = n - d - 1
        hidden = model.mtp_forward(0, tokens[:, d + 1:d + 1 + width], hidden[:, :width], torch.arange(width)[None])
        logits.append(model.logits(hidden)[0])
    return logits


def test_train_depths_past_the_last_layer_reuse_it_on_its_own_output(one_layer_ckpt):
    depths = 3
    model = Engine.from_checkpoint(one_layer_ckpt, EngineConfig(max_batch_size=1)).model
    trainer = Trainer(TrainerConfig(enable_mtp_training=True, mtp_train_depths=depths), one_layer_ckpt)
    trainer.model.eval()
    tokens = torch.tensor([[1, 4, 9, 7, 12, 3, 8, 15, 6, 2, 11]])
    with torch.no_grad():
        megatron = trainer.model.mtp_logits(forward(trainer.model, tokens), depths=depths, reuse_attention="megatron")
        want = repeated_layer_logits(model, tokens, depths)
        # negative control: depth 2 from the trunk state (each depth reading the trunk) instead of depth 1's output
        n = tokens.shape[1]
        trunk = mtp_input_hidden(model, tokens)[:, :n - 2]
        from_trunk = model.logits(model.mtp_forward(0, tokens[:, 2:], trunk, torch.arange(n - 2)[None]))[0]
    assert len(megatron) == depths
    longest = max(2 * TINY["hidden_size"], TINY["intermediate_size"])
    for d in range(depths):
        # depth d chains d+1 passes of the one layer: as deep as layer d of a chained block
        tol = reduction_rtol(longest, depth_of_layer(d)) * max(1.0, want[d].abs().max().item())
        assert (megatron[d][0, :want[d].shape[0]] - want[d]).abs().max().item() <= tol, d
    tol1 = reduction_rtol(longest, depth_of_layer(1)) * max(1.0, want[1].abs().max().item())
    assert (from_trunk - want[1]).abs().max().item() > 100 * tol1


def drafter_reuse_logits(model, tokens, depths):
    """Module-path reference of the drafter's reuse steps, teacher-forced, one drafting point
    at a time and no cache: drafting after position t, step m (0-based) runs the layer over
    positions 0..t+m, whose last entry reads the previous step's output and token t+m+1."""
    n = tokens.shape[1]
    states, logits = mtp_input_hidden(model, tokens), [[] for _ in range(depths)]
    for t in range(n - depths):
        hidden = states[:, :t + 1]
        for m in range(depths):
            out = model.mtp_forward(0, tokens[:, 1:t + m + 2], hidden, torch.arange(t + m + 1)[None])
            logits[m].append(model.logits(out[:, -1])[0])
            hidden = torch.cat([hidden, out[:, -1:]], 1)
    return [torch.stack(x) for x in logits]


def test_drafter_reuse_attention_trains_the_reused_depths_exactly_as_the_drafter_runs_them(one_layer_ckpt):
    depths = 3
    model = Engine.from_checkpoint(one_layer_ckpt, EngineConfig(max_batch_size=1)).model
    tokens = torch.tensor([[1, 4, 9, 7, 12, 3, 8, 15, 6, 2, 11]])
    got = {}
    for mode in ("drafter", "megatron"):
        trainer = Trainer(TrainerConfig(enable_mtp_training=True, mtp_train_depths=depths, mtp_reuse_attention=mode),
                          one_layer_ckpt)
        trainer.model.eval()
        with torch.no_grad():
            got[mode] = trainer.model.mtp_logits(forward(trainer.model, tokens), depths=depths, reuse_attention=mode)
    with torch.no_grad():
        want = drafter_reuse_logits(model, tokens, depths)
    longest = max(2 * TINY["hidden_size"], TINY["intermediate_size"])
    for d in range(depths):
        width = want[d].shape[0]
        tol = reduction_rtol(longest, depth_of_layer(d)) * max(1.0, want[d].abs().max().item())
        assert (got["drafter"][d][0, :width] - want[d]).abs().max().item() <= tol, d
        if d > 0:  # negative control: megatron's chaining attends over its own depth's entries instead
            assert (got["megatron"][d][0, :width] - want[d]).abs().max().item() > 100 * tol, d
