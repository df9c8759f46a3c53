"""The mixture-of-experts MLP of GLM-4.5 and DeepSeek-V3 layers, with the HF parameter names.

`mlp.gate` is the router (`weight` [E, H] and `e_score_correction_bias` [E], the bias that
steers the choice, vime/models/moe_routing.py), `mlp.experts.{e}` the routed SwiGLU experts,
`mlp.shared_experts` one SwiGLU of n_shared_experts x moe_intermediate_size that every token
passes through. `routed_experts` runs each chosen expert once on the tokens that picked it,
whatever computes the expert (the module path here, the engine's packed weights in fast_model.py).
"""
import torch
import torch.nn.functional as F
from torch import nn

from mtp.blocks import SwiGLU
from vime.models.moe_routing import route


class Router(nn.Module):
    """Router logits of the experts plus the correction bias that steers the choice (not the weights)."""

    def __init__(self, cfg):
        super().__init__()
        experts = cfg.moe.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(experts, cfg.hidden_size))
        # trained by a balancing rule, not by gradients; a parameter so weight sync carries it
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts), requires_grad=False)


def routed_experts(x, weights, indices, expert_forward):
    """sum_k weights[t, k] * expert_{indices[t, k]}(x[t]) for x [T, H]: each chosen expert runs once
    on the rows that picked it. expert_forward(e, rows [n, H]) -> [n, H]."""
    out = torch.zeros_like(x)
    for e in indices.unique().tolist():
        token, slot = (indices == e).nonzero(as_tuple=True)
        y = expert_forward(e, x[token]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


class MoE(nn.Module):
    """Routed experts (sigmoid router, group-limited top-k, scaled weights) plus shared experts."""

    def __init__(self, cfg):
        super().__init__()
        self.moe = cfg.moe
        self.gate = Router(cfg)
        self.experts = nn.ModuleList([SwiGLU(cfg, cfg.moe.moe_intermediate_size)
                                      for _ in range(cfg.moe.n_routed_experts)])
        if cfg.moe.n_shared_experts:
            self.shared_experts = SwiGLU(cfg, cfg.moe.moe_intermediate_size * cfg.moe.n_shared_experts)
        self.last_indices = None  # the latest routing's expert indices (pretraining balances the load with it)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        logits = F.linear(flat.float(), self.gate.weight.float())
        weights, indices = route(logits, self.gate.e_score_correction_bias, self.moe)
        self.last_indices = indices.detach()
        out = routed_experts(flat, weights, indices, lambda e, rows: self.experts[e](rows)).view_as(x)
        if self.moe.n_shared_experts:
            out = out + self.shared_experts(x)
        return out
