"""Transformer blocks whose math is the same in every model vime runs (the policy trunk, its MTP
layers, an EAGLE-3 draft), so that each is written once."""
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """SwiGLU feed-forward block: down(silu(gate(x)) * up(x)), with the HF/vLLM parameter names."""

    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
