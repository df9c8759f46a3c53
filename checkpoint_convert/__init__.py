"""Hugging Face <-> Megatron torch_dist converters. They build a trainer to read or write the
torch_dist side, so they sit above `trainer/`; the name maps they use live in `vime/models/`."""
