"""MTP math shared by the engine and the trainer: layer input, loss, sampling, rejection sampling.

Pure torch: nothing here imports Ray or Megatron, so it tests in milliseconds.
"""
