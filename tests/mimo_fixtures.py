"""Tiny MiMo checkpoints for the vLLM tests (Qwen2 trunk with q/k/v bias + `model.mtp_layers.{k}.*`).

head_dim is 32 because vLLM's CPU attention refuses 16.
"""
from rollout.tiny_model import make_random_checkpoint

MIMO_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32)


def make_tiny_mimo(path, seed=0, std=0.3, num_mtp_layers=1):
    """Write a random tiny MiMo checkpoint (with the task tokenizer) into `path`; return path."""
    make_random_checkpoint(path, family="mimo", seed=seed, std=std, num_nextn_predict_layers=num_mtp_layers,
                           **MIMO_SMALL)
    return path
