"""megatron-core trainer: policy loss, online MTP training, torch_dist checkpoints."""
