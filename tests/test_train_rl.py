"""train_rl.py end to end on CPU: real Ray actors, megatron trainer on gloo, wandb offline."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rollout.task import make_prompts, write_jsonl
from rollout.tiny_model import make_random_checkpoint
from tests.conftest import SMALL
from tests.fp32_bounds import close, reduction_rtol

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING_KEYS = ("perf/", "weight_sync/seconds", "weight_sync/bytes_per_s")


def run_train(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline",
               WANDB_SILENT="true", WANDB_API_KEY="")
    env.pop("WANDB_API_KEY")
    return subprocess.run([sys.executable, "train_rl.py", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)


def base_args(ckpt, out, steps=3, *extra):
    return ["--hf-checkpoint", ckpt, "--num-rollout", steps, "--rollout-batch-size", 4, "--n-samples-per-prompt", 4,
            "--global-batch-size", 16, "--micro-batch-size", 8, "--rollout-max-response-len", 12, "--lr", 1e-3,
            "--custom-rm-path", "tests.rewards_for_tests:parity_reward", "--output-dir", out, "--progress", "false",
            "--vllm-speculative-config", '{"method":"mtp","num_speculative_tokens":2}', *extra]


def metrics(out):
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


def rewound_copy(save, dst, step):
    """A copy of a --save directory whose latest checkpoint is `step` (as a run stopped right after that
    save would have left it; the run's last step is always saved too)."""
    import shutil

    shutil.copytree(save, dst)
    with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
        json.dump({"step": step}, f)
    return str(dst)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rl_ckpt"))
    make_random_checkpoint(path, seed=5, std=0.3, **SMALL)
    write_jsonl(make_prompts(64, seed=1), os.path.join(path, "train.jsonl"))
    return path


@pytest.fixture(scope="module")
def online_run(ckpt, tmp_path_factory):
    out, save = tmp_path_factory.mktemp("online"), tmp_path_factory.mktemp("save")
    proc = run_train(*base_args(ckpt, out, 3, "--enable-mtp-training", "--mtp-num-layers", 1,
                                "--save", save, "--save-interval", 2, "--check-weight-update-equal"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(out), str(save)


def initial_draft_checksum(ckpt):
    from vime.models.families import is_mtp_name
    from vime.models.hf_format import load_hf_checkpoint
    from vime.weight_sync import checksum

    cfg, state, _ = load_hf_checkpoint(ckpt)
    return checksum([(k, v) for k, v in state.items() if is_mtp_name(k, cfg.num_hidden_layers)])[0]


@pytest.mark.e2e  # on the whole run `online_run` (about a minute on 2 cores)
def test_online_run_logs_metrics_and_the_draft_follows_the_trainer_every_step(online_run, ckpt):
    out, _ = online_run
    rows = metrics(out)
    assert [r["rollout/step"] for r in rows] == [0, 1, 2]
    for r in rows:
        for key in ("rollout/spec_accept_rate", "rollout/spec_accept_length", "rollout/spec_accept_rate_pos_0",
                    "train/policy_loss", "train/mtp_loss", "train/mtp_grad_norm", "perf/rollout_tokens_per_s"):
            assert key in r and math.isfinite(r[key])
        assert r["train/logprob_abs_diff"] < 1e-4  # trainer and rollout agree on log-probs
    mtp = [initial_draft_checksum(ckpt)] + [r["weight_sync/draft_checksum"] for r in rows]
    assert len(set(mtp)) == len(mtp)  # the draft changed at every step
    wandb_runs = [d for d in os.listdir(os.path.join(out, "wandb")) if d.startswith("offline-run")]
    assert len(wandb_runs) == 1
    assert any(f.endswith(".wandb") for f in os.listdir(os.path.join(out, "wandb", wandb_runs[0])))
    assert os.path.getsize(os.path.join(out, "reward_and_accept_length.png")) > 1000


@pytest.mark.slow  # a whole run of its own (1-2 min on 2 cores)
def test_spec_adaptive_run_on_the_longtail_task_logs_k_and_predicted_vs_measured_speedup(ckpt, tmp_path):
    proc = run_train(*base_args(ckpt, tmp_path, 2, "--spec-adaptive", "--task-variant", "longtail",
                                "--task-variant-prompts", 64, "--rollout-time-plain-baseline"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert len(rows) == 2 and os.path.exists(os.path.join(tmp_path, "prompts_longtail.jsonl"))
    for r in rows:
        assert 0 <= r["rollout/spec_k_mean"] <= 2
        assert r["rollout/spec_predicted_speedup"] > 0 and r["rollout/spec_measured_speedup"] > 0
        assert r["train/logprob_abs_diff"] < 1e-4  # exactness: trainer and rollout still agree
        # the paired plain pass decoded the same batch: strict verification reproduces it (a rare
        # fp32 rounding flip may part one sample from there on)
        assert r["perf/rollout_plain_engine_time"] > 0 and r["perf/spec_speedup_vs_plain"] > 0
        assert r["rollout/plain_same_responses"] >= 1 - 2 / r["rollout/num_samples"]


@pytest.mark.e2e  # on the whole run `online_run` (about a minute on 2 cores)
def test_a_training_save_directory_converts_to_the_hf_weights_the_rollout_was_synced_to(online_run, ckpt, tmp_path):
    from checkpoint_convert import torch_dist_to_hf
    from vime.models.families import is_mtp_name
    from vime.models.hf_format import load_hf_checkpoint
    from vime.weight_sync import checksum

    out, save = online_run
    torch_dist_to_hf.main(["--input-dir", save, "--output-dir", str(tmp_path / "hf"), "--origin-hf-dir", ckpt])
    cfg, state, _ = load_hf_checkpoint(str(tmp_path / "hf"))
    mtp = checksum([(k, v) for k, v in state.items() if is_mtp_name(k, cfg.num_hidden_layers)])[0]
    # the latest checkpoint (step 3: the last step is always saved) holds the weights synced after training step 2
    assert mtp == metrics(out)[2]["weight_sync/draft_checksum"]


@pytest.mark.e2e  # on the whole run `online_run` (about a minute on 2 cores)
def test_killing_the_process_during_a_save_leaves_the_previous_checkpoint_loadable(online_run, ckpt, tmp_path):
    import shutil

    from vime import checkpointing

    _, save = online_run
    root = str(tmp_path / "ckpts")
    shutil.copytree(save, root)
    script = textwrap.dedent(f"""
        import os, time, sys
        sys.path.insert(0, {REPO!r})
        from vime import checkpointing
        def slow_writer(path):
            os.makedirs(path)
            open(os.path.join(path, "partial.bin"), "wb").write(b"x" * 1000)
            print("writing", flush=True)
            time.sleep(60)
        checkpointing.save({root!r}, 4, slow_writer, {{"step": 4}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    step, iteration = checkpointing.latest(root)
    assert step == 3 and checkpointing.load_loop_state(iteration)["step"] == 3
    assert os.path.isdir(os.path.join(root, "iter_0000004.tmp"))
    # the surviving checkpoint still loads into a trainer
    from trainer.config import TrainerConfig
    from trainer.trainer import Trainer

    trainer = Trainer(TrainerConfig(enable_mtp_training=True, mtp_num_layers=1),
                      ckpt, load=os.path.join(iteration, "model"))
    assert sum(p.numel() for p in trainer.model.parameters()) > 0


# a run of its own beside a second one (40-80 s on 2 cores); the default and e2e runs check each part
@pytest.mark.slow
def test_a_resumed_run_beside_a_stale_ray_skips_a_damaged_checkpoint_and_holds_its_output_dir(online_run, ckpt,
                                                                                              tmp_path):
    """One real run, three guarantees: it starts its own Ray although Ray's temp dir names another
    cluster (a `ray start` that has ended); `--load ROOT` passes over the newest checkpoint, whose
    common.pt is cut short, in one line and resumes from the one before, reproducing the uninterrupted
    run's step and appending to its log; a second run on its --output-dir meanwhile is refused in one
    line naming it."""
    import shutil
    import tempfile

    out, save = online_run
    root = str(tmp_path / "save")
    shutil.copytree(save, root)  # steps 2 and 3 (--save-interval 2; the last step is always saved)
    with open(os.path.join(root, "iter_0000003", "model", "common.pt"), "r+b") as f:
        f.truncate(10)
    run_out = tmp_path / "out"
    run_out.mkdir()
    shutil.copy(os.path.join(out, "metrics.jsonl"), run_out / "metrics.jsonl")  # the interrupted run's log
    ray_tmp = tempfile.mkdtemp(prefix="vr", dir="/tmp")  # short: Ray's socket paths live under it
    os.makedirs(os.path.join(ray_tmp, "ray"))
    with open(os.path.join(ray_tmp, "ray", "ray_current_cluster"), "w") as f:
        f.write("127.0.0.1:1")  # what `ray start` leaves there, and keeps after it has ended
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline", WANDB_SILENT="true", RAY_TMPDIR=ray_tmp)
    env.pop("RAY_ADDRESS", None)
    args = base_args(ckpt, run_out, 3, "--enable-mtp-training", "--mtp-num-layers", 1, "--use-wandb", "false")
    proc = subprocess.Popen([sys.executable, "train_rl.py", *map(str, args), "--load", root], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lock = run_out / ".vime_run.lock"
        deadline = time.time() + 120
        while time.time() < deadline and f'"pid": {proc.pid},' not in (lock.read_text() if lock.exists() else ""):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        second = subprocess.run([sys.executable, "train_rl.py", *map(str, args)], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=300)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert [x for x in second.stderr.splitlines() if x.startswith("error:")] == [
        x for x in second.stderr.splitlines() if x.strip()], second.stderr[-3000:]
    assert f"error: --output-dir {run_out} is in use by another run (pid {proc.pid} on host " in second.stderr
    assert proc.returncode == 0, stderr[-3000:]
    skipped = [x for x in stdout.splitlines() if "passed over" in x]
    assert skipped == [f"[vime] --load {root}: resuming from step 2 (iter_0000002), passed over: iter_0000003 "
                       f"(model/common.pt has 10 bytes, the manifest says "
                       f"{os.path.getsize(os.path.join(save, 'iter_0000003', 'model', 'common.pt'))})"], stdout[-3000:]
    resumed, original = metrics(run_out), metrics(out)
    assert [r["rollout/step"] for r in resumed] == [0, 1, 2]  # appended from the checkpoint's step on
    assert resumed[:2] == original[:2]
    for key, value in original[2].items():
        if not key.startswith(TIMING_KEYS):
            assert resumed[2][key] == value, key


@pytest.mark.slow  # a whole run of its own (1-2 min on 2 cores)
def test_a_dead_actor_ends_the_run_with_one_line_naming_it_and_the_checkpoint_to_load(ckpt, tmp_path):
    save = tmp_path / "save"
    proc = run_train(*base_args(ckpt, tmp_path / "out", 4, "--save", save, "--save-interval", 1,
                                "--custom-rm-path", "tests.rewards_for_tests:dies_in_second_step"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert errors == [f"error: the rollout manager died at step 1 (its process exited or was killed, e.g. out of "
                      f"memory); resume with --load {save} (last checkpoint: step 1)"], proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == errors[0]  # wandb's closing lines (offline) come before it
    assert "Traceback" not in proc.stderr and "ActorDiedError" not in proc.stderr
    assert [r["rollout/step"] for r in metrics(tmp_path / "out")] == [0]


@pytest.mark.slow  # a whole run of its own (1-2 min on 2 cores)
def test_ctrl_c_prints_one_line_and_no_traceback(ckpt, tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline")
    out = tmp_path / "out"
    # a suite started as a background job (`cmd &`) inherits SIGINT ignored, and Python keeps an
    # inherited SIG_IGN: give the run the terminal's default, as a foreground Ctrl-C would find it
    save = tmp_path / "save"
    proc = subprocess.Popen([sys.executable, "train_rl.py", *map(str, base_args(ckpt, out, 100000, "--use-wandb", "false",
                                                                               "--save", save, "--save-interval", 1))],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    log = save / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 300
    while time.time() < deadline and not log.exists():
        time.sleep(0.5)
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    errors = [x for x in stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    m = re.fullmatch(rf"error: interrupted \(Ctrl-C\) at step (\d+); resume with --load {re.escape(str(save))} "
                     rf"\(last checkpoint: step (\d+)\)", errors[0])
    assert m and int(m.group(2)) <= int(m.group(1)), errors[0]
    assert os.path.isdir(save / f"iter_{int(m.group(2)):07d}")  # the checkpoint it names exists


def no_model_ckpt(tmp_path):
    path = str(tmp_path / "no_mtp")
    make_random_checkpoint(path, seed=5, num_nextn_predict_layers=0, **SMALL)
    write_jsonl(make_prompts(8, seed=1), os.path.join(path, "train.jsonl"))
    return path


def assert_refused_before_actors(proc, needle):
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-2000:]
    assert "Ray" not in proc.stdout + proc.stderr.replace(errors[0], "")


BAD_INPUTS = [
    (["--enable-mtp-training"], "--enable-mtp-training needs --mtp-num-layers"),
    (["--global-batch-size", 5], "--global-batch-size 5 must divide"),
    (["--rm-type", "nope"], "--rm-type 'nope' is unknown"),
    (["--custom-rm-path", "no_such_module:f"], "--custom-rm-path"),
    (["--prompt-data", "/nonexistent.jsonl"], "--prompt-data /nonexistent.jsonl: no such file"),
    (["--input-key", "question"], "line 1 has no key 'question'"),
    (["--vllm-speculative-config", '{"method": "mtp", "num_speculative_tokens": 0}'], "num_speculative_tokens"),
    (["--tensor-model-parallel-size", 3], "--tensor-model-parallel-size 3 does not divide"),
    (["--vllm-speculative-config", '{"method": "mtp", "num_speculative_tokens": 1, '
      '"rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 0.5}'], "benchmark-only"),
    (["--rollout-temperature", 0], "--rollout-temperature 0"),
    (["--rollout-top-p", 1.5], "--rollout-top-p 1.5"),
    (["--kl-loss-type", "k9"], "--kl-loss-type 'k9'"),
    (["--spec-adaptive=maybe"], "--spec-adaptive takes true or false"),
    (["--task-variant", "nope"], "--task-variant 'nope': choose one of add, chat_arithmetic, longtail"),
    (["--rollout-backend", "vllm", "--rollout-time-plain-baseline"], "--rollout-time-plain-baseline times the embedded"),
    (["--spec-adaptive", "--vllm-speculative-config", "null"], "--spec-adaptive chooses how many tokens to draft"),
    (["--spec-adaptive", "--vllm-speculative-config", '{"method": "mtp", "num_speculative_tokens": 2, '
      '"num_speculative_tokens_per_batch_size": [[1, 4, 2]]}'], "give one of them"),
    (["--vllm-speculative-config", '{"method": "mtp", "num_speculative_tokens": 2, '
      '"num_speculative_tokens_per_batch_size": [[2, 4, 2]]}'], "must start at 1"),
]
# whole train_rl.py processes (exit 2, one line, no Ray) for a flag, a file and a reward function; every
# case goes through the same pre-start checks in-process below
WHOLE_PROCESS = ("--enable-mtp-training needs", "--prompt-data /nonexistent.jsonl", "--custom-rm-path")


def args_without_reward(ckpt, tmp_path):
    args = base_args(ckpt, tmp_path, 1)
    cut = args.index("--custom-rm-path")
    return args[:cut] + args[cut + 2:]


@pytest.mark.parametrize("extra, needle", [c for c in BAD_INPUTS if c[1].startswith(WHOLE_PROCESS)])
def test_bad_input_is_a_one_line_error_before_any_actor_starts(ckpt, tmp_path, extra, needle):
    assert_refused_before_actors(run_train(*args_without_reward(ckpt, tmp_path), *extra, timeout=120), needle)


@pytest.mark.parametrize("extra, needle", BAD_INPUTS)
def test_bad_input_is_refused_by_the_pre_start_checks(ckpt, tmp_path, extra, needle):
    from bad_input_helpers import refused

    refused([str(a) for a in (*args_without_reward(ckpt, tmp_path), *extra)], needle)


def test_an_incomplete_checkpoint_is_refused_before_any_actor_starts(ckpt, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = str(tmp_path / "broken")
    shutil.copytree(ckpt, broken)
    state = load_file(os.path.join(broken, "model.safetensors"))
    state.pop(next(k for k in sorted(state) if "mtp" in k or ".layers.2." in k))  # an MTP tensor, in any family
    save_file(state, os.path.join(broken, "model.safetensors"))
    assert_refused_before_actors(run_train(*base_args(broken, tmp_path, 1), timeout=120),
                                 "tensor(s) the config implies are missing")


def test_mtp_speculation_on_a_checkpoint_without_mtp_layers_is_refused(tmp_path):
    assert_refused_before_actors(run_train(*base_args(no_model_ckpt(tmp_path), tmp_path, 1), timeout=120), "mtp")


@pytest.mark.slow  # a whole run of its own (1-2 min on 2 cores)
def test_debug_rollout_only_saves_rollouts_that_debug_train_only_trains_on(ckpt, tmp_path):
    data = tmp_path / "rollouts"
    proc = run_train(*base_args(ckpt, tmp_path / "r", 2, "--debug-rollout-only", "--save-debug-rollout-data", data,
                                "--use-wandb", "false"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rollout_rows = metrics(tmp_path / "r")
    assert len(rollout_rows) == 2 and all("rollout/reward" in r and "train/policy_loss" not in r for r in rollout_rows)
    assert sorted(os.listdir(data)) == ["step_0000000.pkl", "step_0000001.pkl"]
    proc = run_train(*base_args(ckpt, tmp_path / "t", 2, "--debug-train-only", "--load-debug-rollout-data", data,
                                "--use-wandb", "false"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    train_rows = metrics(tmp_path / "t")
    assert len(train_rows) == 2 and all("train/policy_loss" in r and "rollout/reward" not in r for r in train_rows)
    assert train_rows[0]["train/logprob_abs_diff"] < 1e-4  # trained on exactly the saved rollouts


@pytest.mark.slow  # a whole run of its own (1-2 min on 2 cores)
def test_tensor_parallel_trainers_sync_full_weights_to_the_rollout(ckpt, tmp_path):
    proc = run_train(*base_args(ckpt, tmp_path, 2, "--tensor-model-parallel-size", 2, "--enable-mtp-training",
                                "--mtp-num-layers", 1, "--check-weight-update-equal", "--use-wandb", "false"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert len(rows) == 2
    for r in rows:  # TP-sharded trainer, gathered weights: the rollout computes the same log-probs
        assert r["train/logprob_abs_diff"] < 1e-5


@pytest.mark.slow  # a whole run of its own (1-2 min on 2 cores)
def test_two_data_parallel_trainers_train_like_one(ckpt, tmp_path):
    # --adam-eps = --lr keeps Adam from amplifying DP's different fp32 summation order (see the TP test)
    common = ("--enable-mtp-training", "--mtp-num-layers", 1, "--use-wandb", "false", "--adam-eps", 1e-3)
    rtol = reduction_rtol(SMALL["intermediate_size"], 3 * 2 * 2 * SMALL["num_hidden_layers"] + 4)
    runs = {}
    for dp in (1, 2):
        out = tmp_path / f"dp{dp}"
        proc = run_train(*base_args(ckpt, out, 2, "--data-parallel-size", dp, *common))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[dp] = metrics(out)
    for one, two in zip(runs[1], runs[2]):  # same samples; DP splits them and all-reduces the gradients
        for key in ("train/policy_loss", "train/mtp_loss", "train/grad_norm", "weight_sync/target_checksum",
                    "weight_sync/draft_checksum"):
            assert close(two[key], one[key], rtol, scale=max(abs(one[key]), 1.0)), key


@pytest.mark.slow  # a whole run of its own (1-2 min on 2 cores)
def test_kl_loss_is_zero_against_the_reference_at_the_start_and_grows_after(ckpt, tmp_path):
    proc = run_train(*base_args(ckpt, tmp_path, 2, "--use-kl-loss", "--kl-loss-coef", 0.1, "--use-wandb", "false"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert abs(rows[0]["train/kl"]) < 1e-7  # the policy is the reference before its first update
    assert rows[1]["train/kl"] > 1e-5


def test_samples_generated_with_other_weights_than_the_pushed_version_stop_the_run():
    from orchestration.driver import WeightSyncError
    from orchestration.rl_run import check_weight_versions
    from vime.sample import Sample

    fresh = [Sample(prompt_ids=[1], weight_version=3) for _ in range(3)]
    check_weight_versions(fresh, expected=3)  # control: all generated with the pushed weights
    with pytest.raises(WeightSyncError, match=r"weight version\(s\) \[2\]"):
        check_weight_versions(fresh + [Sample(prompt_ids=[1], weight_version=2)], expected=3)
