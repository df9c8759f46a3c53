"""Tolerances for comparing two fp32 computations that differ only in reduction order.

Two CPUs (AVX2 vs AVX-512), two TP shards or two DP ranks sum the same terms in a
different order. Higham's bound for a length-n sum is |error| <= n * u * sum|terms|
(u = 2**-24, the fp32 unit roundoff); a chain of `depth` such reductions compounds to
about depth * n * u relative. Tolerances are that worst case, scaled by the quantity:
still orders of magnitude below what a real bug (a wrong shard, a missing all-reduce)
changes, and independent of the machine that runs the test. The bf16 bounds at the end follow
the same rule with bf16's unit roundoff.
"""
FP32_UNIT_ROUNDOFF = 2.0 ** -24


def reduction_rtol(longest_reduction, depth):
    """Worst-case relative error of `depth` chained fp32 reductions of length <= `longest_reduction`."""
    return depth * longest_reduction * FP32_UNIT_ROUNDOFF


def probable_reduction_rtol(longest_reduction, depth):
    """Relative error that `depth` chained fp32 reductions of length <= `longest_reduction` exceed with
    negligible probability: modelling each rounding as an independent zero-mean error (Higham and
    Mary's probabilistic analysis, SIAM J. Sci. Comput. 2019), a length-n sum is within lam * sqrt(n) * u
    except with probability 2 exp(-lam^2 / 2), and the `depth` links add in quadrature; depth * sqrt(n)
    * u is that bound at lam = sqrt(depth) (exceeded with probability < 2 exp(-depth / 2): 1e-16 at
    depth 76). Where the worst case `reduction_rtol` is too loose to tell a layout's result from one
    rank's at the 1e-4 a user compares them at, this is the bound two reduction orders stay within."""
    return depth * longest_reduction ** 0.5 * FP32_UNIT_ROUNDOFF


def close(a, b, rtol, scale=None):
    """|a - b| <= rtol * scale, scale defaulting to max(|a|, |b|, 1): losses are means of O(1)
    terms, so when they cancel to near zero the terms' size, not the result's, sets the error."""
    scale = max(abs(a), abs(b), 1.0) if scale is None else scale
    return abs(a - b) <= rtol * scale


def model_logprob_bound(cfg, context, max_abs_logit):
    """|log-prob difference| of two fp32 forwards of the model of `cfg` (a ModelConfig, MLA's latent
    widths included) that differ in reduction order only: each logit is within reduction_rtol *
    max|logit| of the exact one (the longest sum of the model, chained through its depth, MTP layer
    included), and log_softmax moves a log-prob by at most twice the largest logit change."""
    return 2 * 2 * reduction_rtol(longest_reduction(cfg, context), forward_depth(cfg.num_hidden_layers + 1)) * max_abs_logit


def longest_reduction(cfg, context):
    """The longest sum a forward of the model of `cfg` (a ModelConfig) takes over `context` positions:
    a matmul's inner width (hidden, MLP, the MTP layer's concatenation, attention heads, MLA's latent),
    or attention over the context."""
    widths = [cfg.hidden_size, cfg.intermediate_size, 2 * cfg.hidden_size, context,
              cfg.num_attention_heads * cfg.head_dim]
    if cfg.mla:
        widths += [cfg.mla.latent_width, cfg.num_attention_heads * cfg.mla.v_head_dim]
    return max(widths)


# bf16 (--bf16): 8 significant bits, unit roundoff 2**-8. Matmuls and sums accumulate in fp32 on
# every kernel vime runs (torch's CPU kernels, cuBLAS, vLLM's), so what differs between two bf16
# forwards of the same weights is where each rounds a stored activation to bf16: each rounding is
# a relative error <= u, and `depth` chained ones move a result by <= depth * u relative (first
# order), plus the fp32 reduction-order term above.
BF16_UNIT_ROUNDOFF = 2.0 ** -8


def bf16_rtol(longest_reduction, depth):
    """Worst-case relative error of a bf16 forward `depth` roundings deep (fp32 accumulation)."""
    return depth * BF16_UNIT_ROUNDOFF + reduction_rtol(longest_reduction, depth)


def forward_depth(num_layers):
    """Chained roundings of a decoder forward: 2 per sub-layer (its output, the residual add),
    2 sub-layers per layer, plus the embedding, the final norm, the head and the log-softmax."""
    return 2 * 2 * num_layers + 4


def bf16_logprob_bound(num_layers, longest_reduction, max_abs_logit, temperature):
    """|log-prob difference| between two bf16 forwards of the same weights (the trainer's and the
    rollout's): each side's logits are within bf16_rtol * max|logit| of the exact ones, so they
    differ by twice that; log_softmax at T moves a log-prob by at most twice the largest logit
    difference divided by T."""
    rtol = bf16_rtol(longest_reduction, forward_depth(num_layers))
    return 2 * 2 * rtol * max_abs_logit / temperature


def max_abs_logit(ckpt, samples):
    """The largest |logit| the checkpoint's fp32 model gives over the samples' tokens (the scale of
    `model_logprob_bound`)."""
    import torch

    from rollout.embedded.model import CausalLMWithMTP
    from vime.models.hf_format import load_hf_checkpoint

    cfg, state, _ = load_hf_checkpoint(ckpt)
    model = CausalLMWithMTP(cfg).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return max(model.logits(model(torch.tensor([s.prompt_ids + s.response_ids]),
                                      torch.arange(len(s.prompt_ids) + len(s.response_ids))[None])).abs().max().item()
                   for s in samples)


def max_logprob_diff(got, want):
    """The largest |log-prob difference| between two runs' samples, position by position."""
    return max(max(abs(a - b) for a, b in zip(s.rollout_logprobs, w.rollout_logprobs)) for s, w in zip(got, want))


def greedy_logprob_bound(ckpt, samples):
    """`model_logprob_bound` for two fp32 runs of the checkpoint over these samples: its config,
    their longest context and the largest logit the model gives on them."""
    from vime.models.hf_format import read_config

    context = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    return model_logprob_bound(read_config(ckpt), context, max_abs_logit(ckpt, samples))
