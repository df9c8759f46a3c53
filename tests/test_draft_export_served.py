"""The draft an online run trained, exported and served by plain vLLM (no vime code between), accepts
what the run logged (slow: a 3-step run on the vLLM backend, then a second vLLM start), for each
external draft kind: EAGLE-3 and DFlash (its shipped draft, blocks of 4), both at k = 3.

The run (--enable-draft-training, --rollout-backend vllm) evaluates the held-out prompts greedily
(--eval-temperature 0) at its last step, with the policy and the draft of step 2 that the trainer
synced into vLLM in place, and saves that step (--save-interval 2). Step 2's policy
(checkpoint_convert.torch_dist_to_hf) and draft (scripts/export_draft.py) are then served by
`vllm.LLM(model=POLICY, speculative_config={"method": METHOD, "model": DRAFT, ...})` on the same
prompts, greedy, and vLLM's own spec-decode counters (`llm.get_metrics()`) are read.

Reference and bound: the run's eval/spec_* of its last step. Both are vLLM's counts of the same
weights on the same greedy prompts, so they differ only where fp32 reordering flips a near-tie; the
acceptance rates must agree within 3 standard errors of a difference of two binomial proportions
(pooled), a bound derived from the draft counts, not from this machine.
"""
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

import dflash_fixtures  # noqa: E402
from eagle3_fixtures import DRAFT, REPO, TARGET  # noqa: E402

pytestmark = pytest.mark.slow
K, STEPS, MAX_NEW = 3, 3, 40
DRAFTS = {"eagle3": DRAFT, "dflash": dflash_fixtures.DRAFT}  # method -> its shipped draft for TARGET (k = 3)
EVAL = os.path.join(TARGET, "eval.jsonl")


def run(cmd, timeout):
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true"))
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module", params=list(DRAFTS))
def trained(tmp_path_factory, request):
    """(method, the run's last metrics row, exported policy dir, exported draft dir)."""
    method = request.param
    tmp = tmp_path_factory.mktemp(f"online_{method}")
    spec = json.dumps({"method": method, "model": DRAFTS[method], "num_speculative_tokens": K})
    run([sys.executable, "train_rl.py", "--hf-checkpoint", TARGET, "--vllm-speculative-config", spec,
         "--enable-draft-training", "--rollout-backend", "vllm", "--num-rollout", str(STEPS),
         "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "32",
         "--micro-batch-size", "32",
         "--rollout-max-response-len", str(MAX_NEW), "--eval-prompt-data", EVAL, "--eval-interval", str(STEPS - 1),
         "--eval-temperature", "0", "--n-samples-per-eval-prompt", "1", "--save", str(tmp / "save"),
         "--save-interval", str(STEPS - 1), "--output-dir", str(tmp / "run"), "--progress", "false"], timeout=1500)
    metrics = [json.loads(line) for line in open(tmp / "run" / "metrics.jsonl")]
    iteration = str(tmp / "save" / f"iter_{STEPS - 1:07d}")  # the weights the last step evaluated
    run([sys.executable, "scripts/export_draft.py", "--load", iteration, "--out", str(tmp / "draft")], 300)
    run([sys.executable, "-m", "checkpoint_convert.torch_dist_to_hf", "--input-dir", iteration,
         "--output-dir", str(tmp / "policy"), "--origin-hf-dir", TARGET], 300)
    return method, metrics[-1], str(tmp / "policy"), str(tmp / "draft")


def eval_prompts():
    from rollout.tokenizer import TextCodec  # the run's own prompt ids (input preparation, not serving)

    codec = TextCodec(TARGET)
    bos = json.load(open(os.path.join(TARGET, "config.json")))["bos_token_id"]
    return [codec.prompt_ids(json.loads(line)["prompt"], bos) for line in open(EVAL) if line.strip()]


def spec_counters(llm):
    """vLLM's spec-decode counters: drafts, draft tokens, accepted tokens, accepted per position."""
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted",
             "vllm:spec_decode_num_accepted_tokens_per_pos": "per_pos"}
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * K}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] = list(m.values) if hasattr(m, "values") else m.value
    return out


def plain_vllm_acceptance(method, policy, draft, prompts):
    """vLLM's counters over greedy generation of `prompts`, served with no vime code."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    eos = json.load(open(os.path.join(policy, "config.json")))["eos_token_id"]
    llm = LLM(model=policy, speculative_config={"method": method, "model": draft, "num_speculative_tokens": K},
              skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=128,
              seed=0, disable_log_stats=False)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[eos], detokenize=False)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return spec_counters(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


def within_3_se(accepted_a, n_a, accepted_b, n_b):
    pooled = (accepted_a + accepted_b) / (n_a + n_b)
    se = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / n_a + 1 / n_b))
    return abs(accepted_a / n_a - accepted_b / n_b) <= 3 * se, se


@pytest.mark.timeout(3600)  # a run and two vLLM starts: past pytest.ini's 900 s on 2 busy cores
def test_the_exported_draft_served_by_plain_vllm_accepts_what_the_run_logged(trained):
    method, logged, policy, draft = trained
    assert logged["rollout/step"] == STEPS - 1 and "eval/spec_accept_rate" in logged  # evaluated at the last step
    assert logged["train/draft_1_loss"] > 0
    got = plain_vllm_acceptance(method, policy, draft, eval_prompts())
    assert got["draft_tokens"] == K * got["drafts"] > 0
    served_rate = got["accepted"] / got["draft_tokens"]
    served_length = 1 + got["accepted"] / got["drafts"]
    ok, se = within_3_se(got["accepted"], got["draft_tokens"], logged["eval/spec_accepted_tokens"],
                         logged["eval/spec_draft_tokens"])
    print(f"{method} served: accept rate {served_rate:.4f} length {served_length:.3f} ({got['accepted']}/{got['draft_tokens']}, "
          f"per position {got['per_pos']}); logged: {logged['eval/spec_accept_rate']:.4f} length "
          f"{logged['eval/spec_accept_length']:.3f} ({logged['eval/spec_accepted_tokens']}/"
          f"{logged['eval/spec_draft_tokens']}); 3 SE = {3 * se:.4f}")
    assert ok
    for i, accepted in enumerate(got["per_pos"]):  # per position: the same bound on each position's rate
        logged_rate = logged[f"eval/spec_accept_rate_pos_{i}"]
        n = logged["eval/spec_draft_tokens"] // K
        assert within_3_se(accepted, got["drafts"], round(logged_rate * n), n)[0], i
