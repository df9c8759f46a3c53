"""The draft models and the draft maths the engine and the trainer share.

The drafts: the MTP layer's input (layer.py), the external drafts' models (eagle3.py, dflash.py,
dspark.py, on the shared transformer blocks of blocks.py) and their offline warm-up (draft_warmup.py).
The maths every draft uses: the draft losses (loss.py), drafting at depths past the last MTP layer
(reuse.py), sampling (sampling.py) and rejection sampling (rejection.py).

Pure torch: nothing here imports Ray, Megatron or vLLM, so it tests in milliseconds.
"""
