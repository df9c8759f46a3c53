"""Transformer blocks whose math is the same in every model vime runs (the policy trunk, its MTP
layers, an EAGLE-3 draft), so that each is written once."""
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """SwiGLU feed-forward block: down(silu(gate(x)) * up(x)), with the HF/vLLM parameter names.
    `intermediate_size` overrides the config's (an MoE expert's width)."""

    def __init__(self, cfg, intermediate_size=None):
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
