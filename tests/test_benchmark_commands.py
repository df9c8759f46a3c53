"""Every command BENCHMARKS.md lists runs, at a tiny size, and prints what its section reads.

`TINY` holds, for each listed command, the flags that shrink it (appended, so argparse keeps them over the
command's own), the inputs its placeholders stand for (DIR, OUT, runs/...: made here at a tiny size, by the
commands BENCHMARKS lists for them where it lists them), and what its output must show. A command runs in a
scratch directory whose code and checkpoints are the repository's, so what it writes (runs/, docs/*.png,
out.jsonl) stays there. A GPU command on a machine without CUDA must refuse in one line. The list of commands
is read from the page: a command added there without an entry here fails the first test.
"""

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINKED = (
    "checkpoints",
    "configs",
    "scripts",
    "tests",
    "mtp",
    "vime",
    "rollout",
    "trainer",
    "orchestration",
    "checkpoint_convert",
    "train_rl.py",
)
RL = ("--steps", "1", "--window", "1")  # one RL step an arm, its start and end that step


@dataclasses.dataclass(frozen=True)
class Tiny:
    """How a test runs one listed command: `extra` flags appended (before a `--` that passes the rest on), the
    placeholders it names replaced by inputs made here (`inputs`), and patterns its output must match."""

    prints: tuple
    extra: tuple = ()
    inputs: tuple = ()
    cuda: bool = False  # a GPU command: on a machine without CUDA it must refuse in one line


def spec_decode(*extra):
    return ("--num-prompts", "2", "--batch-sizes", "1,2", "--max-new-tokens", "6", "--repeats", "1", *extra)


VS_VLLM = (r"plain\s+1\s+[\d.]+\s+[\d.]+\s+[\d.]+x", r"mtp k=2\s+1\s+[\d.]+\s+[\d.]+\s+[\d.]+x")
SPEC_TABLE = (r"\| batch \| method \| tokens/s \| speedup", r"paired speedup")
DRIFT = (r"arm \(end = last 1 steps\)", r"accept_len start", r"wrote .*drift\.csv")
SMOLLM2_DRIFT = (
    "python scripts/bench/rl_arms.py drift --draft mtp --hf-checkpoint checkpoints/smollm2-135m-instruct "
    "--draft-warmup-steps 200 --arms online:lr=1e-3:lr_warmup=10,frozen,none --steps 25 "
    "--out runs/smollm2_drift --curves runs/smollm2_drift/positions.png -- --task-variant chat_arithmetic "
    "--apply-chat-template --input-key messages --rm-type math --rollout-batch-size 8 --n-samples-per-prompt 4 "
    "--global-batch-size 32 --micro-batch-size 8 --rollout-max-response-len 32 --lr 2e-5 --actor-num-cpus-per-node 2 "
    "--rollout-num-cpus-per-engine 2"
)
SMOLLM2 = (("checkpoints/smollm2-135m-instruct", "llama_chat"),)  # a random Llama with a chat template stands in
SMOLLM2_RECIPE_FLAGS = (
    "--task-variant chat_arithmetic --apply-chat-template --input-key messages --rm-type math "
    "--rollout-batch-size 8 --n-samples-per-prompt 4 --global-batch-size 32 --micro-batch-size 8 "
    "--rollout-max-response-len 32 --lr 2e-5 --actor-num-cpus-per-node 2 --rollout-num-cpus-per-engine 2"
)
SMOLLM2_TV = (
    "python scripts/bench/rl_arms.py drift --draft mtp --hf-checkpoint checkpoints/smollm2-135m-instruct "
    "--draft-warmup-steps 200 --arms online:lr=1e-3:lr_warmup=10:loss=tv,frozen --steps 25 --out runs/smollm2_tv "
    f"-- {SMOLLM2_RECIPE_FLAGS}"
)
SMOLLM2_DFLASH = (
    "python scripts/bench/rl_arms.py drift --draft dflash --hf-checkpoint checkpoints/smollm2-135m-instruct "
    "--draft-warmup-steps 200 --arms online:lr_warmup=10:steps=1:replay=0,frozen --steps 25 --out runs/smollm2_dflash "
    f"-- {SMOLLM2_RECIPE_FLAGS}"
)
SMOLLM2_DSPARK = (
    "python scripts/bench/rl_arms.py drift --draft dspark --hf-checkpoint checkpoints/smollm2-135m-instruct "
    "--draft-warmup-steps 200 --arms online:lr_warmup=10:steps=1:replay=0,online:lr_warmup=10:steps=8:replay=4,frozen "
    f"--steps 25 --out runs/smollm2_dspark -- {SMOLLM2_RECIPE_FLAGS}"
)
SMOLLM2_EAGLE3 = (
    "python scripts/bench/rl_arms.py drift --draft eagle3 --hf-checkpoint checkpoints/smollm2-135m-instruct "
    "--draft-warmup-steps 200 --arms online:draft_vocab=4096:lr_warmup=10:steps=1:replay=0,"
    "online:draft_vocab=4096:lr_warmup=10:steps=4:replay=2,online:draft_vocab=4096:lr_warmup=10:steps=8:replay=4,"
    "frozen:draft_vocab=4096 "
    f"--steps 25 --out runs/smollm2_eagle3 -- {SMOLLM2_RECIPE_FLAGS}"
)
SMOLLM2_EAGLE3_VLLM = (
    "python scripts/bench/rl_arms.py drift --draft eagle3 --hf-checkpoint checkpoints/smollm2-135m-instruct "
    "--draft-model runs/smollm2_eagle3/eagle3_draft-vocab-size4096_draft_warmup200 "
    "--arms online:lr_warmup=10:steps=1:replay=0,none --backends vllm --steps 5 --out runs/smollm2_eagle3_vllm -- "
    "--task-variant chat_arithmetic --apply-chat-template --input-key messages --rm-type math --rollout-batch-size 8 "
    "--n-samples-per-prompt 4 --global-batch-size 32 --micro-batch-size 8 --rollout-max-response-len 32 --lr 2e-5"
)
SMOLLM2_VLLM = (
    "python scripts/bench/rl_arms.py drift --draft mtp --hf-checkpoint checkpoints/smollm2-135m-instruct --arms none "
    "--backends vllm --steps 25 --out runs/smollm2_vllm -- --task-variant chat_arithmetic --apply-chat-template "
    "--input-key messages --rm-type math --rollout-batch-size 8 --n-samples-per-prompt 4 --global-batch-size 32 "
    "--micro-batch-size 8 --rollout-max-response-len 32 --lr 2e-5"
)
SMOLLM2_POLICY_EAGLE3 = (
    "python scripts/make_eagle3_draft.py --target runs/smollm2/policy --out runs/smollm2/eagle3_draft --warmup-steps 200 "
    "--draft-vocab-size 4096 --input-key messages --label-key label --max-new-tokens 32 --prompt-data "
    "runs/smollm2/prompts_chat_arithmetic.jsonl --apply-chat-template"
)
SMOLLM2_SPEC = "python scripts/bench/throughput.py spec-decode --hf-checkpoint runs/smollm2/policy --eagle3-draft " \
    "runs/smollm2/eagle3_draft --task-variant chat_arithmetic --batch-sizes {} --max-new-tokens 48 --stop-at-eos {} " \
    "--threads 2"
SMOLLM2_T1 = ('--temperature 1 --rejection-sample-method strict --methods "none,mtp k=1,mtp adaptive,eagle3 k=2,'
              'eagle3 k=3,eagle3 adaptive"')
TINY = {
    "python train_rl.py experiment=smollm2_math --save runs/smollm2/save": Tiny(
        (r"has no MTP layers: adding 1 fresh one",),
        ("--hf-checkpoint", "checkpoints/smollm2-135m-instruct", "--num-rollout", "1", "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--micro-batch-size", "2",
         "--rollout-max-response-len", "8", "--mtp-warmup-steps", "2", "--mtp-warmup-samples", "4",
         "--use-wandb", "false", "--progress", "false"),
        SMOLLM2,
    ),
    "python -m checkpoint_convert.torch_dist_to_hf --input-dir runs/smollm2/save --output-dir runs/smollm2/policy "
    "--origin-hf-dir runs/smollm2/fresh_mtp_checkpoint": Tiny((r"saved HF checkpoint",)),
    SMOLLM2_POLICY_EAGLE3: Tiny((r"saved runs/smollm2/eagle3_draft",), (
        "--warmup-steps", "2", "--warmup-samples", "4", "--draft-vocab-size", "16", "--max-new-tokens", "4")),
    SMOLLM2_SPEC.format("1 --num-prompts 32", f"--repeats 3 {SMOLLM2_T1}"): Tiny(
        SPEC_TABLE + (r"eagle3 adaptive drafted k",), spec_decode()),
    SMOLLM2_SPEC.format("2,4 --num-prompts 8", f"--repeats 2 {SMOLLM2_T1}"): Tiny(
        SPEC_TABLE + (r"eagle3 adaptive drafted k",), spec_decode()),
    SMOLLM2_SPEC.format("8,16,32,64 --num-prompts 64", f"--repeats 2 {SMOLLM2_T1}"): Tiny(
        SPEC_TABLE + (r"eagle3 adaptive drafted k",), spec_decode()),
    SMOLLM2_SPEC.format("32 --num-prompts 64", '--repeats 10 --temperature 1 --rejection-sample-method strict '
                        '--methods "none,eagle3 k=2,eagle3 adaptive" --versus "eagle3 k=2/none,eagle3 adaptive/none"'):
        Tiny(SPEC_TABLE + (r"eagle3 adaptive / none paired [\d.]+x, faster in",), spec_decode()),
    SMOLLM2_SPEC.format("1 --num-prompts 32", '--repeats 3 --temperature 0 --methods "none,mtp k=1,eagle3 k=2,'
                        'eagle3 k=3,eagle3 k=4" --costs'):
        Tiny(SPEC_TABLE + (r"eagle3 k=4: a verify of 5 tokens.*in the timed runs a drafting step cost [\d.]+x",),
             spec_decode()),
    SMOLLM2_SPEC.format("16 --num-prompts 64", '--repeats 10 --temperature 1 --rejection-sample-method strict '
                        '--methods "none,mtp k=1,mtp adaptive" --versus "mtp adaptive/none,mtp k=1/none"'):
        Tiny(SPEC_TABLE + (r"mtp adaptive / none paired [\d.]+x, faster in",), spec_decode()),
    SMOLLM2_EAGLE3_VLLM: Tiny((r"arm \(end = last 1 steps\)", r"vllm/none"), RL, SMOLLM2 + (
        ("runs/smollm2_eagle3/eagle3_draft-vocab-size4096_draft_warmup200", "llama_chat_eagle3"),)),
    SMOLLM2_VLLM: Tiny((r"arm \(end = last 1 steps\)", r"vllm/none"), RL, SMOLLM2),
    "python scripts/bench/throughput.py vs-hf --hf-checkpoint checkpoints/smollm2-135m-instruct --task-variant "
    "chat_arithmetic --batch-sizes 1,4,16,64 --max-new-tokens 32 --threads 1": Tiny(
        (r"\n\s+1\s+[\d.]+\s+[\d.]+\s+[\d.]+x",), ("--batch-sizes", "1", "--max-new-tokens", "4"), SMOLLM2
    ),
    "python scripts/bench/throughput.py vs-vllm --hf-checkpoint checkpoints/smollm2-135m-instruct --task-variant "
    "chat_arithmetic --arms plain --batch-sizes 1,4,16,64 --max-new-tokens 32 --repeats 2 --threads 1": Tiny(
        VS_VLLM[:1], ("--batch-sizes", "1", "--max-new-tokens", "4", "--repeats", "1"), SMOLLM2
    ),
    SMOLLM2_DRIFT: Tiny(
        DRIFT,
        (*RL, "--draft-warmup-steps", "2", "--arms", "online:lr=1e-3,none"),
        SMOLLM2,
    ),
    SMOLLM2_TV: Tiny(DRIFT, (*RL, "--draft-warmup-steps", "2", "--arms", "online:lr=1e-3:loss=tv"), SMOLLM2),
    SMOLLM2_DFLASH: Tiny(DRIFT, (*RL, "--draft-warmup-steps", "2", "--arms", "online:steps=1:replay=0"), SMOLLM2),
    SMOLLM2_DSPARK: Tiny(DRIFT, (*RL, "--draft-warmup-steps", "2", "--arms", "online:steps=1:replay=0"), SMOLLM2),
    SMOLLM2_EAGLE3: Tiny(DRIFT, (*RL, "--draft-warmup-steps", "2", "--arms", "online:draft_vocab=16:steps=1:replay=0"),
                         SMOLLM2),
    "python scripts/bench/throughput.py step-limit --hf-checkpoint checkpoints/smollm2-135m-instruct --repeats 5": Tiny(
        (r"copy bandwidth", r"eager\s+[\d.]+\s+[\d.]+%"), ("--repeats", "1", "--steps", "2", "--max-new-tokens", "4"),
        SMOLLM2,
    ),
    "python scripts/bench/throughput.py step-limit --hf-checkpoint checkpoints/smollm2-135m-instruct --repeats 5 "
    "--threads 2": Tiny(
        (r"copy bandwidth", r"eager\s+[\d.]+\s+[\d.]+%"), ("--repeats", "1", "--steps", "2", "--max-new-tokens", "4"),
        SMOLLM2,
    ),
    "python scripts/bench/throughput.py vs-vllm --hf-checkpoint checkpoints/tiny-mimo-mtp --repeats 3": Tiny(
        VS_VLLM + (r"mtp k=1\s+1 ",), ("--batch-sizes", "1", "--max-new-tokens", "4", "--repeats", "1")
    ),
    'python scripts/bench/throughput.py vs-vllm --hf-checkpoint checkpoints/tiny-glm4-moe-mtp --arms "plain,mtp k=2" '
    "--repeats 3": Tiny(VS_VLLM, ("--batch-sizes", "1", "--max-new-tokens", "4", "--repeats", "1")),
    "python scripts/bench/throughput.py vs-hf --hf-checkpoint artifacts/tiny-qwen3-mtp": Tiny(
        (r"\n\s+1\s+[\d.]+\s+[\d.]+\s+[\d.]+x",),
        ("--batch-sizes", "1", "--max-new-tokens", "4"),
        (("artifacts/tiny-qwen3-mtp", "checkpoints/tiny-qwen2"),),
    ),
    "python scripts/bench/throughput.py compaction": Tiny(
        (r"ratio [\d.]+; same responses 128 of 128",), ("--batches", "1", "--max-new-tokens", "8")
    ),
    "python scripts/bench/throughput.py step-limit --repeats 5": Tiny(
        (r"copy bandwidth", r"eager\s+[\d.]+\s+[\d.]+%"),
        (
            "--repeats",
            "1",
            "--steps",
            "2",
            "--max-new-tokens",
            "4",
            "--copy-mib",
            "16",
            "--layers",
            "2",
            "--hidden",
            "256",
            "--intermediate",
            "512",
        ),
    ),
    "python scripts/bench/throughput.py step-limit --device cuda --dtype bfloat16 --layers 24 --hidden 2048 "
    "--intermediate 5632": Tiny((r"copy bandwidth",), ("--repeats", "1", "--steps", "2", "--layers", "2"), cuda=True),
    "python scripts/bench/mla.py cache --prompts 8": Tiny(
        (r"KV bytes per token .*ratio 0\.\d+", r"greedy tokens equal to transformers' on 2/2"),
        ("--prompts", "2", "--max-new-tokens", "4"),
    ),
    "python scripts/bench/mla.py rope-op": Tiny(
        (r"T=   1 H=128: contiguous .* torch / contiguous [\d.]+x",), ("--repeats", "1", "--calls", "2")
    ),
    "python scripts/bench/mla.py rope-engine --hf-checkpoint DIR": Tiny(
        (r"batch  1: contiguous .* same greedy tokens",), ("--repeats", "1", "--new-tokens", "4"), (("DIR", "mla"),)
    ),
    "python -m rollout.generate --hf-checkpoint checkpoints/tiny-glm4-moe-mtp --prompts "
    "checkpoints/tiny-glm4-moe-mtp/eval.jsonl --output out.jsonl --max-new-tokens 64 --temperature 0 "
    """--vllm-speculative-config '{"method":"mtp","num_speculative_tokens":2}'""": Tiny(
        (r"generated 256 samples", r"spec: accept_rate [\d.]+\s+accept_length"), ("--max-new-tokens", "4")
    ),
    "python scripts/bench/spec_ceiling.py --hf-checkpoint runs/lt_online/hf --batches 16": Tiny(
        (r"ceiling: an oracle", r"\| k \| B=1"),
        ("--batches", "1", "--max-new-tokens", "8"),
        (("runs/lt_online/hf", "checkpoints/tiny-mimo-longtail"),),
    ),
    "python scripts/bench/throughput.py spec-decode --hf-checkpoint runs/lt/qwen2-longtail --dflash-drafts "
    'runs/lt/dflash-b4,runs/lt/dflash-b8 --methods "none,dflash k=3,dflash k=3 adaptive,dflash k=7,dflash k=7 '
    'adaptive" '
    "--task-variant longtail --num-prompts 16 --batch-sizes 1,2,4,8,16 --max-new-tokens 128 --repeats 3 --stop-at-eos "
    "--min-response-len 24 --temperature 1 --rejection-sample-method strict": Tiny(
        SPEC_TABLE + (r"dflash k=3 adaptive",),
        spec_decode("--methods", "none,dflash k=3,dflash k=3 adaptive", "--min-response-len", "2"),
        (
            ("runs/lt/qwen2-longtail", "checkpoints/tiny-qwen2"),
            ("runs/lt/dflash-b4,runs/lt/dflash-b8", "checkpoints/tiny-qwen2-dflash"),
        ),
    ),
    "python scripts/bench/rl_arms.py drift --draft dspark --arms "
    '"online:k=4:ce_weight=1:l1_weight=0,online:draft=dflash" '
    "--draft-warmup-steps 20 --save-arms": Tiny(DRIFT, ("--out", "OUT", *RL), (("OUT", "dspark_arms"),)),
    "python -m checkpoint_convert.torch_dist_to_hf --input-dir OUT/embedded_online_k-4_ce_weight-1_l1_weight-0/save "
    "--output-dir OUT/policy --origin-hf-dir checkpoints/tiny-qwen2": Tiny(
        (r"saved HF checkpoint",), (), (("OUT", "dspark_arms"),)
    ),
    "python scripts/export_draft.py --load OUT/embedded_online_k-4_ce_weight-1_l1_weight-0/save --out "
    "OUT/dspark4": Tiny((r"saved .*dspark4 \(the dspark draft",), (), (("OUT", "dspark_arms"),)),
    "python scripts/export_draft.py --load OUT/embedded_online_draft-dflash/save --out OUT/dflash": Tiny(
        (r"saved .*dflash \(the dflash draft",), (), (("OUT", "dspark_arms"),)
    ),
    "python scripts/bench/throughput.py spec-decode --clock cpu --hf-checkpoint OUT/policy --dspark-drafts OUT/dspark4 "
    '--dflash-drafts OUT/dflash --methods "none,dspark k=4 sized,dspark k=4,dflash k=3" --num-prompts 128 '
    "--batch-sizes 1,2,4,8,16,32,64,128 --max-new-tokens 64 --repeats 5 --min-seconds 20 --stop-at-eos --temperature 1 "
    "--rejection-sample-method strict "
    '--versus "dspark k=4 sized/none,dspark k=4/none,dspark k=4 sized/dspark k=4"': Tiny(
        SPEC_TABLE + (r"dspark k=4 sized drafted k = ", r"dspark k=4 sized / dspark k=4 paired [\d.]+x"),
        spec_decode("--min-seconds", "0"),
        (("OUT", "dspark_arms"),),
    ),
    "python scripts/bench/throughput.py spec-decode --clock cpu --hf-checkpoint checkpoints/tiny-qwen2 --dspark-drafts "
    'checkpoints/tiny-qwen2-dspark --methods "none,dspark k=3 sized,dspark k=3" --num-prompts 64 --batch-sizes 1,64 '
    "--max-new-tokens 64 --repeats 30 --stop-at-eos --temperature 0 "
    '--versus "dspark k=3 sized/none,dspark k=3/none"': Tiny(
        SPEC_TABLE + (r"dspark k=3 sized / none paired [\d.]+x",), spec_decode()
    ),
    "python scripts/bench/throughput.py spec-scale --device cuda --dtype bfloat16 --repeats 3": Tiny(
        (r"online",), ("--repeats", "1", "--batch-sizes", "1", "--max-new-tokens", "4", "--layers", "2"), cuda=True
    ),
    "python scripts/bench/rl_arms.py drift --draft mtp": Tiny(DRIFT, ("--out", "runs/drift_mtp", *RL)),
    "python scripts/bench/rl_arms.py drift --draft mtp --backends vllm --out runs/mtp_drift_vllm --arms "
    "none,online,online:sync_draft=false": Tiny(DRIFT, RL),
    "python scripts/bench/rl_arms.py drift --hf-checkpoint checkpoints/tiny-glm4-moe-mtp --arms online,frozen "
    "--backends "
    "embedded,vllm --out runs/bench_drift_glm": Tiny(DRIFT, RL),
    "python scripts/bench/rl_arms.py drift --draft eagle3 --backends embedded,vllm --arms frozen,online "
    "--draft-warmup-steps 20 --png docs/eagle3_drift.png": Tiny(DRIFT, ("--out", "runs/drift_eagle3", *RL)),
    "python scripts/bench/rl_arms.py drift --draft dflash --arms blocks --draft-warmup-steps 20 --png "
    "docs/dflash_blocks_drift.png": Tiny(DRIFT, ("--out", "runs/drift_dflash", *RL)),
    "python scripts/bench/rl_arms.py drift --draft dspark --arms dspark --draft-warmup-steps 20 --save-arms --png "
    "docs/dspark_drift.png": Tiny(DRIFT, ("--out", "runs/drift_dspark", *RL)),
    "python scripts/bench/rl_arms.py drift --draft dflash --draft-warmup-steps 20 --reuse --png "
    "docs/dflash_layers_drift.png --arms online:draft=eagle3,online:k=7:draft_layers=2,online:k=7:draft_layers=3": Tiny(
        DRIFT, ("--out", "runs/drift_layers", *RL)
    ),
    "python scripts/bench/rl_arms.py drift --draft dflash --backends vllm --draft-warmup-steps 20 --reuse --png "
    "docs/dflash_layers_drift_vllm.png --arms online:draft=eagle3,online:k=7:draft_layers=3": Tiny(
        DRIFT, ("--out", "runs/drift_layers_vllm", *RL)
    ),
    "python scripts/bench/draft_ceiling.py --hf-checkpoint checkpoints/tiny-qwen2 --oracle-only --k 7 "
    "--eval-contexts 2000": Tiny(
        (r"\| drafter \(k = 7\) \| tokens / verify", r"oracle"), ("--eval-contexts", "8", "--max-new-tokens", "8")
    ),
    "python scripts/bench/rl_arms.py drift --draft mtp --num-speculative-tokens 3 --steps 80 --out runs/mtp_replay80 "
    '--curves docs/mtp_replay_80_steps.png --arms "online:depths=3:steps=16:replay=8,frozen"': Tiny(DRIFT, RL),
    "python scripts/bench/draft_ceiling.py --hf-checkpoint runs/ceiling_rl/hf --out runs/ceiling_rl/ceiling.json": Tiny(
        (r"\| drafter \(k = 3\) \| tokens / verify", r"oracle"),
        ("--eval-contexts", "8", "--max-new-tokens", "8", "--train-prompts", "8", "--train-steps", "2", "--batch", "4"),
        (("runs/ceiling_rl/hf", "checkpoints/tiny-mimo-mtp"), ("runs/ceiling_rl/ceiling.json", "ceiling.json")),
    ),
    "python scripts/bench/trainer_step.py --hidden 384 --steps 8": Tiny(
        (r"\| 4 layers, hidden 64",), ("--hidden", "64", "--steps", "1", "--warmup", "0", "--response-len", "8")
    ),
    "python scripts/bench/trainer_layouts.py": Tiny(
        (r"\| 1 rank \| 1 \| \d+ ms",), ("--layouts", "1 rank", "--steps", "1")
    ),
    "python scripts/bench/trainer_layouts.py --hf-checkpoint checkpoints/tiny-deepseek-v3-mtp": Tiny(
        (r"tiny-deepseek-v3-mtp: global batch", r"\| 1 rank \| 1 \| \d+ ms"), ("--layouts", "1 rank", "--steps", "1")
    ),
    "python scripts/bench/trainer_layouts.py --options": Tiny(
        (r"\| --use-distributed-optimizer \| \d+ ms \| [\d.]+x",), ("--steps", "1", "--warmup", "0", "--samples", "8")
    ),
    "python scripts/bench/weight_sync.py engines --workers 1": Tiny(
        (r"hand-over / broadcast: [\d.]+x",), ("--hidden", "64")
    ),
    "python scripts/bench/weight_sync.py engines --workers 2": Tiny((r"2 worker\(s\)",), ("--hidden", "64")),
    "python scripts/bench/weight_sync.py stages": Tiny((r"gather / per stage: [\d.]+x",), ("--hidden", "64")),
    "python scripts/bench/weight_sync.py stages --workers 2": Tiny((r"to 2 engine\(s\)",), ("--hidden", "64")),
    "python scripts/bench/weight_sync.py stages --stages 4": Tiny((r"over 4 stages",), ("--hidden", "64")),
    "bash scripts/gpu_check.sh": Tiny((r"tests/gpu",), cuda=True),
    "python scripts/bench/checkpoint_manifest.py": Tiny(
        (r"\| tiny-mimo-mtp \| [\d.]+ MiB",), ("--models", "tiny-mimo-mtp")
    ),
    "python scripts/bench/rl_arms.py async --steps 12": Tiny(
        (r"\| sync \|", r"\| async \|"), ("--out", "runs/async", "--steps", "2")
    ),
    "python scripts/bench/rl_arms.py engines --workers 2 --steps 6": Tiny(
        (r"engine",), ("--out", "runs/engines", "--steps", "2", "--batch-sizes", "2")
    ),
    "python scripts/bench/rl_arms.py engines --workers 2 --steps 6 --batch-sizes 64 --out runs/bench_engines_vllm -- "
    "--rollout-backend vllm": Tiny((r"engine",), ("--steps", "2", "--batch-sizes", "2")),
    "python scripts/bench/rl_arms.py dynamic --steps 30 --seeds 42,2,3": Tiny(
        (r"\| plain \| 42 \|", r"reward, dynamic - plain, per seed"),
        ("--out", "runs/dynamic", "--steps", "1", "--seeds", "42"),
    ),
    "python scripts/bench/soak.py --steps 200": Tiny((r"RSS @ step 20", r"largest peak"), ("--steps", "21")),
    "python scripts/bench/rl_arms.py routing --steps 20": Tiny(
        (r"disagree",), ("--out", "runs/routing", "--steps", "1")
    ),
    "python scripts/bench/routing_replay_step.py --steps 20": Tiny(
        (r"\| \d+ samples, fp32 \| \d+ ms \| \d+ ms \|",), ("--steps", "1", "--warmup", "0", "--prompts", "2")
    ),
    "python scripts/bench/rl_arms.py dtype --steps 8 --seeds 1234:42": Tiny(
        (r"bf16",), ("--out", "runs/dtype", "--steps", "1")
    ),
    "python -m pytest -q -m slow tests/test_bf16.py -k vllm": Tiny((r"\d+ tests? collected",), ("--collect-only",)),
}


def listed_commands():
    """Every command BENCHMARKS.md lists: its indented code lines that run python or bash."""
    lines = (REPO / "BENCHMARKS.md").read_text().splitlines()
    return [line.strip() for line in lines if re.match(r"    (python|bash) ", line)]


def test_every_command_benchmarks_lists_has_a_tiny_run_here():
    listed = listed_commands()
    assert [c for c in listed if c not in TINY] == []
    assert [c for c in TINY if c not in listed] == []


def has_cuda():
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory whose code and checkpoints are the repository's (linked) and whose outputs are its own."""
    root = tmp_path_factory.mktemp("bench")
    for name in LINKED:
        (root / name).symlink_to(REPO / name)
    (root / "docs").mkdir()
    return root


def made_inputs(scratch, name):
    """The input a placeholder stands for, made once per module at a tiny size."""
    if name == "mla":
        target = scratch / "mla-deepseek"
        if not target.exists():
            sys.path.insert(0, str(REPO / "tests"))
            from moe_fixtures import DEEPSEEK_ON_CPU_KERNEL, write_checkpoint

            write_checkpoint(str(target), "deepseek_v3", seed=21, **DEEPSEEK_ON_CPU_KERNEL)
        return str(target)
    if name == "llama_chat":
        return str(llama_chat(scratch))
    if name == "llama_chat_eagle3":
        return str(llama_chat_eagle3(scratch))
    if name == "dspark_arms":
        return str(scratch / "dspark_arms")
    return name  # a path of the repository itself, or a file name inside the scratch directory


def llama_chat(scratch):
    """A random chat Llama without MTP layers, standing in for SmolLM2-135M-Instruct."""
    from rollout.tiny_model import make_random_chat_checkpoint

    target = scratch / "llama-chat"
    if not target.exists():
        make_random_chat_checkpoint(str(target), seed=3, std=0.3, family="llama", num_nextn_predict_layers=0)
    return target


def llama_chat_eagle3(scratch):
    """A reduced-vocabulary EAGLE-3 draft of `llama_chat` (its 16 lowest ids), not warmed up: what the draft the
    drift benchmark made (4096 of SmolLM2's tokens) stands for."""
    target = scratch / "llama-chat-eagle3"
    if not target.exists():
        code = ("import sys; sys.path.insert(0, 'scripts'); from make_eagle3_draft import init_draft; "
                "from vime.models.eagle3 import EAGLE3; from vime.models.hf_format import load_hf_checkpoint; "
                "cfg, state, _ = load_hf_checkpoint(sys.argv[1], '--target'); "
                "d = init_draft(cfg, state, 0, draft_vocab_size=16); EAGLE3.save(sys.argv[2], d.cfg, d.state_dict())")
        out = subprocess.run([sys.executable, "-c", code, str(llama_chat(scratch)), str(target)], cwd=REPO,
                             capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert out.returncode == 0, out.stderr[-2000:]
    return target


def argv_of(command, tiny, scratch):
    """The command's argv at a tiny size, in the scratch directory."""
    argv = shlex.split(command)
    cut = argv.index("--") if "--" in argv else len(argv)
    argv = argv[:cut] + list(tiny.extra) + argv[cut:]
    for placeholder, name in tiny.inputs:
        argv = [a.replace(placeholder, made_inputs(scratch, name)) for a in argv]
    return [sys.executable if a == "python" else a for a in argv[:1]] + argv[1:]


def run_listed(command, scratch):
    tiny = TINY[command]
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="offline")
    proc = subprocess.run(
        argv_of(command, tiny, scratch), cwd=scratch, capture_output=True, text=True, env=env, timeout=1800
    )
    return proc, tiny


# the inputs of the DSpark table come from the commands listed before it: run in the page's order
ORDERED = sorted(TINY, key=lambda c: listed_commands().index(c) if c in listed_commands() else 0)


@pytest.mark.slow
@pytest.mark.parametrize("command", ORDERED)
def test_a_listed_command_runs_at_a_tiny_size_and_prints_its_table(command, scratch):
    tiny = TINY[command]
    proc, tiny = run_listed(command, scratch)
    out = proc.stdout + proc.stderr
    if tiny.cuda and not has_cuda():
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode != 0 and len(errors) == 1 and "Traceback" not in proc.stderr, out[-3000:]
        return
    assert proc.returncode == 0, out[-3000:]
    missing = [p for p in tiny.prints if not re.search(p, out)]
    assert missing == [], out[-3000:]
