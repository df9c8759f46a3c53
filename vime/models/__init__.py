"""Model families and their formats, pure and read by every side: the family registry, the HF
checkpoint format, and the name maps to megatron-core and to vLLM's parameters."""
