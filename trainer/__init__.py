"""megatron-core trainer: policy loss, the online draft (trainer/drafts: MTP layers, EAGLE-3, DFlash, DSpark),
torch_dist checkpoints."""

from trainer.cpu_patches import quiet_megatron_warnings

quiet_megatron_warnings()  # before any trainer module imports megatron-core
