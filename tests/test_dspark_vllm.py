"""DSpark and vLLM: the draft's directory is what vLLM's own DSpark model class loads, and the CPU build,
which cannot draft DSpark, is refused in one line.

vLLM 0.32 drafts DSpark (and sizes verification by confidence) only in its GPU model runner (Model
Runner V2 with Triton kernels); its CPU build refuses both ("Model Runner V1 does not support: dspark
speculative decoding", and V2 "requires Triton"). So the format is checked where the CPU build can
check it: vLLM's `Qwen3DSparkForCausalLM`, built from the engine config a GPU build makes of the
same speculative config, takes the draft through its own `load_weights`, every parameter it does
not share from the target is filled with exactly the draft's tensor (names and shapes matched), and
its Markov bias and confidence equal the draft's (tests/gpu serves it on a GPU).
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from bad_input_helpers import refused  # noqa: E402
from dflash_fixtures import REPO, TARGET  # noqa: E402
from dspark_fixtures import DRAFT  # noqa: E402

# run in a child: vLLM's model class needs its distributed state and current config, which must not
# outlive the check in the test process
LOAD_INTO_VLLM = r'''
import json, sys, tempfile
import torch
from rollout.vllm.backend import _set_env, engine_kwargs
_set_env("cpu")
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
from mtp.dspark import DSparkDraft, acceptance_confidence
from vime.models.dspark import DSPARK

target, draft_dir = sys.argv[1], sys.argv[2]
cfg, state = DSPARK.load(draft_dir)
# the config a GPU build makes: the CPU build's V1-runner refusal of dspark left out, nothing else
v1 = VllmConfig._get_v1_model_runner_unsupported_features
VllmConfig._get_v1_model_runner_unsupported_features = lambda self: [f for f in v1(self) if "dspark" not in f]
spec = {"method": "dspark", "model": draft_dir, "num_speculative_tokens": cfg.block_size}
config = EngineArgs(**engine_kwargs(target, spec, 4, "cpu", torch.float32)).create_engine_config()
with set_current_vllm_config(config):
    init_distributed_environment(1, 0, "file://" + tempfile.mktemp(), 0, "gloo")
    ensure_model_parallel_initialized(1, 1)
    model = Qwen3DSparkForCausalLM(vllm_config=config, prefix="")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.load_weights(state.items())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}  # as loaded, before repacking
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    process_weights_after_loading(model, config.speculative_config.draft_model_config, torch.device("cpu"))
    v, q, kv = cfg.vocab_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    fused = {"self_attn.q_proj": ("self_attn.qkv_proj", 0, q), "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
             "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
             "mlp.gate_proj": ("mlp.gate_up_proj", 0, cfg.intermediate_size),
             "mlp.up_proj": ("mlp.gate_up_proj", cfg.intermediate_size, cfg.intermediate_size)}
    report = {"architecture": config.speculative_config.draft_model_config.architectures, "tensors": {},
              "not_loaded": []}
    filled = set()
    for name, tensor in state.items():
        vllm_name, rows = "model." + name, slice(None)
        for part, (whole, start, size) in fused.items():
            if part in name:
                vllm_name, rows = "model." + name.replace(part, whole), slice(start, start + size)
        got = params[vllm_name][rows]
        if name.startswith("markov_head.markov_w2"):
            got = got[:v]  # vLLM pads the head's vocabulary rows
        filled.add(vllm_name)
        report["tensors"][name] = [list(tensor.shape), list(got.shape), bool(torch.equal(got, tensor))]
    shared = ("embed_tokens", "lm_head", "mask_embedding")  # the target's (and an unused placeholder)
    report["not_loaded"] = [n for n, p in params.items() if n not in filled and not any(s in n for s in shared)]
    draft = DSparkDraft(cfg)
    draft.load_state_dict(state)
    tokens = torch.arange(v)
    embed = model.markov_embed(tokens)
    bias = model.markov_bias(embed)[:, :v]
    ours = draft.markov_logits(torch.zeros(v, v), tokens)[0]  # zero base logits: the bias alone
    report["markov_bias"] = float((bias - ours).abs().max())
    report["markov_scale"] = float(bias.abs().max())
    if cfg.enable_confidence_head:
        hidden = torch.randn(v, cfg.hidden_size)
        report["confidence"] = float((model.compute_confidence(hidden, embed)
                                      - acceptance_confidence(draft, hidden, embed)).abs().max())
        head = draft.confidence_head  # one fp32 dot product per slot: its length and sum of |terms| bound it
        x = torch.cat([hidden, embed], -1) if head.with_markov else hidden
        report["confidence_width"] = x.shape[-1] + 1
        report["confidence_scale"] = float((x.float().abs() @ head.proj.weight.float().abs().T
                                            + head.proj.bias.float().abs()).max())
print("REPORT " + json.dumps(report))
'''


def load_into_vllm(draft_dir):
    proc = subprocess.run([sys.executable, "-c", LOAD_INTO_VLLM, TARGET, draft_dir], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, PYTHONPATH=REPO))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT "):])


@pytest.mark.slow  # a vLLM import and engine config in a child: ~15 s
def test_the_shipped_draft_loads_into_vllms_dspark_model_class_with_every_tensor_matched():
    from fp32_bounds import FP32_UNIT_ROUNDOFF, reduction_rtol

    report = load_into_vllm(DRAFT)
    assert report["architecture"] == ["Qwen3DSparkModel"]
    assert report["tensors"] and all(shape == got and equal for shape, got, equal in report["tensors"].values()), \
        report["tensors"]
    assert report["not_loaded"] == []  # every parameter vLLM does not share from the target came from the file
    with open(os.path.join(DRAFT, "config.json")) as f:
        rank = json.load(f)["markov_rank"]
    assert report["markov_bias"] <= reduction_rtol(rank, 1) * max(1.0, report["markov_scale"])
    # the sigmoid's slope is at most 1/4: a logit's summation-order error, plus the sigmoid's own roundings
    logit_error = reduction_rtol(report["confidence_width"], 1) * report["confidence_scale"]
    assert report["confidence"] <= logit_error / 4 + 4 * FP32_UNIT_ROUNDOFF


def test_the_cpu_build_of_vllm_refuses_dspark_and_confidence_sized_verification_in_one_line(tmp_path):
    base = ["--hf-checkpoint", TARGET, "--rollout-backend", "vllm", "--vllm-speculative-config"]
    refused(base + [json.dumps({"method": "dspark", "model": DRAFT, "num_speculative_tokens": 3})],
            "--vllm-speculative-config", "CPU build of vLLM cannot draft DSpark", "GPU model runner",
            "--rollout-backend embedded")
    refused(base + [json.dumps({"method": "dflash", "model": os.path.join(REPO, "checkpoints", "tiny-qwen2-dflash"),
                                "num_speculative_tokens": 3, "enable_adaptive_verification": True})],
            "CPU build of vLLM cannot size verification by a draft's confidence", "--rollout-backend embedded")
