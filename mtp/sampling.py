"""Token distributions and sampling shared by the engine, the rejection sampler and the trainer.

Log-prob convention (one definition everywhere): a token's log-prob is taken under the
distribution actually sampled from — softmax(logits / temperature), restricted to top-k /
top-p and renormalised. With top_k=0 and top_p=1 (the RL default) that is
log_softmax(logits / T), exactly what the trainer computes. Greedy requests (T = 0) report
log_softmax(logits), i.e. temperature 1.
"""
import torch


def effective_temperature(temperature):
    """Greedy (0) is reported at temperature 1."""
    return temperature if temperature > 0 else 1.0


def logprobs_at_temperature(logits, temperature):
    """log_softmax(logits / T) in fp32: the trainer's and the engine's token log-probs."""
    return torch.log_softmax(logits.float() / effective_temperature(temperature), dim=-1)


def token_logprobs(logits, tokens, temperature):
    """Log-prob of `tokens` [B, S] under logits [B, S, V] at `temperature`."""
    return logprobs_at_temperature(logits, temperature).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def filter_top_k_top_p(logits, top_k, top_p):
    """Set logits outside the top-k / nucleus to -inf. logits [..., V] (already divided by T)."""
    if top_k and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep a token if the mass strictly before it is < top_p (the first token always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def processed_logprobs(logits, temperature, top_k=0, top_p=1.0):
    """Log-probs of the distribution a request samples from (fp32, -inf outside the support)."""
    scaled = logits.float() / effective_temperature(temperature)
    return torch.log_softmax(filter_top_k_top_p(scaled, top_k, top_p), dim=-1)


def sample_with_uniforms(probs, uniforms):
    """Inverse-CDF sampling: one token per row of probs [N, V] from uniforms [N] in [0, 1).

    Driving sampling by per-request uniforms keeps each request's draws independent of
    which other requests share the batch.
    """
    cdf = probs.cumsum(-1)
    u = uniforms.to(cdf.dtype).unsqueeze(-1) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    # u * cdf[-1] can round up to cdf[-1] (u near 1 in fp32): searchsorted then passes the
    # last positive token and lands on a zero-probability one; the last token with
    # probability > 0 is the right answer there
    last_positive = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(-1)
    return torch.minimum(idx, last_positive)
