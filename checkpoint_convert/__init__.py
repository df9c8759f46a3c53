"""Hugging Face <-> Megatron torch_dist checkpoints, and the name maps they share with weight sync."""
