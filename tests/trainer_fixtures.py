"""Shared helpers for the trainer tests: tiny checkpoints and hand-made batches."""
import torch

from rollout.embedded.model import CausalLMWithMTP
from rollout.tiny_model import make_random_checkpoint
from trainer.batch import build_batch
from vime.models.hf_format import load_hf_checkpoint
from vime.sample import Sample

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def engine_model(path):
    """The embedded engine's model of HF checkpoint `path` (the trainer's reference), in eval mode."""
    cfg, state, _ = load_hf_checkpoint(path)
    model = CausalLMWithMTP(cfg)
    model.load_state_dict(state, strict=False)
    return model.eval()


def engine_mtp_logits(model, tokens, mtp_hidden):
    """The engine model's MTP layer 0 logits at positions 0..S-2: token t+1 and the trunk state
    `mtp_hidden` (as that family's MTP layer reads it) at t."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model.logits(model.mtp_forward(0, tokens[:, 1:], mtp_hidden[:, :-1], positions[:, :-1]))


def make_tiny(path, **overrides):
    return make_random_checkpoint(str(path), **{**TINY, **overrides})


def random_scored_samples(n=4, prompt_len=4, seed=0, vocab=32, advantages=None):
    """n Samples as the trainer receives them: random prompt and response ids, rollout log-probs
    near -3, and an advantage each (all in one prompt group)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        resp_len = 5 + i
        samples.append(Sample(
            prompt_ids=torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
            response_ids=torch.randint(0, vocab, (resp_len,), generator=g).tolist(),
            rollout_logprobs=(-3.0 + 0.1 * torch.randn(resp_len, generator=g)).tolist(),
            advantage=(advantages[i] if advantages is not None else float(i) - 1.5), index=0, sample_index=i))
    return samples


def make_batch(**kw):
    return build_batch(random_scored_samples(**kw))
