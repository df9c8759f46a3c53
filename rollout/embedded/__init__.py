"""vime's embedded inference engine: slot KV cache, continuous batching, proposers and exact
speculative verification. The CPU default and the exactness reference for the vLLM backend."""
