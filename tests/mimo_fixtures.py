"""Tiny MiMo checkpoints for the vLLM tests (Qwen2 trunk with q/k/v bias + `model.mtp_layers.{k}.*`).

Once the model-family registry exists, `make_random_checkpoint(path, family="mimo", ...)` writes
a true MiMo checkpoint and is used; until then a Qwen2 trunk is written with transformers and
the MTP layers are added in MiMo names. head_dim is 32 because vLLM's CPU attention refuses 16.
"""
import inspect
import json
import os

import torch

MIMO_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32)


def _family_api_exists():
    from rollout.tiny_model import make_random_checkpoint

    return "family" in inspect.signature(make_random_checkpoint).parameters


def make_tiny_mimo(path, seed=0, std=0.3, num_mtp_layers=1):
    """Write a random tiny MiMo checkpoint (with the task tokenizer) into `path`; return path."""
    if _family_api_exists():
        from rollout.tiny_model import make_random_checkpoint

        make_random_checkpoint(path, family="mimo", seed=seed, std=std, num_nextn_predict_layers=num_mtp_layers,
                               **MIMO_SMALL)
        return path
    return _write_with_transformers(path, seed, std, num_mtp_layers)


def _write_with_transformers(path, seed, std, num_mtp_layers):
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rollout.task import BOS, EOS, PAD
    from rollout.tokenizer import build_tokenizer, save_tokenizer

    s = MIMO_SMALL
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=32, hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                      num_hidden_layers=s["num_hidden_layers"], num_attention_heads=s["num_attention_heads"],
                      num_key_value_heads=s["num_key_value_heads"], tie_word_embeddings=True,
                      max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                      bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    model = Qwen2ForCausalLM(cfg)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    h = s["hidden_size"]
    for k in range(num_mtp_layers):
        layer = Qwen2ForCausalLM(cfg).model.layers[0].state_dict()
        for name, v in layer.items():
            state[f"model.mtp_layers.{k}.{name}"] = v
        for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            state[f"model.mtp_layers.{k}.{name}.weight"] = torch.ones(h)
        state[f"model.mtp_layers.{k}.input_proj.weight"] = torch.zeros(h, 2 * h)
    for name, v in state.items():  # peaked, varied distributions: normal(std) matrices, biases too
        if v.dim() == 2 or name.endswith(".bias"):
            torch.nn.init.normal_(v, std=std if v.dim() == 2 else 0.1)
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    d = cfg.to_dict()
    d.update(architectures=["MiMoForCausalLM"], model_type="qwen2", num_nextn_predict_layers=num_mtp_layers,
             torch_dtype="float32")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    save_tokenizer(build_tokenizer(), path)
    return path
