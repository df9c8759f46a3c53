"""The vLLM rollout backend: a `vllm.LLM` of the policy (`backend`), the weights it serves with, loaded
in place and read back for the sync guard (`weights`), vLLM's NCCL weight-transfer engine, both of
its ends (`weight_transfer`), and the functions that run inside vLLM's worker process (`worker`)."""
