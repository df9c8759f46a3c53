"""Bad input by kind, each through a command's own entry point (its `main(argv)`, or the script as a
process): exit code 2, one line that says what is true, and no input file changed.

Kinds: checkpoint metadata read as typed data; a manifest written over a dangling symbolic link; a
binary file where a JSON config is expected; an empty string where a path is expected; an output
that is an input (or a directory replaced whole that holds one); a knob the run's draft or engine
settings leave idle; and messages that must name what is there (a file is not "no such directory", a
string is not "an integer", a stage split never "leaves -1 layers")."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

import train_rl
from checkpoint_convert import hf_to_torch_dist, torch_dist_to_hf
from dflash_fixtures import DRAFT as DFLASH_DRAFT
from dflash_fixtures import TARGET as QWEN2_TARGET
from rollout import generate
from tests.test_bad_inputs_tools import converted  # noqa: F401 (fixture)
from tests.test_train_rl import ckpt  # noqa: F401 (fixture)
from vime import manifest
from vime.checkpointing import LATEST, LOOP_STATE
from vime import memory_plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def contents(*roots):
    """{path: sha256} of every file under `roots` (or the file itself): what must not change."""
    found = {}
    for root in map(str, roots):
        paths = [root] if os.path.isfile(root) else [os.path.join(d, n) for d, _, ns in os.walk(root) for n in ns]
        for path in paths:
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    found[path] = hashlib.sha256(f.read()).hexdigest()
    return found


def one_line(capsys, main, argv):
    """Run a command's main in this process; its exit code must be 2 with one `error:` line, returned."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (code, err)
    return err[0]


def script_one_line(script, *args):
    proc = subprocess.run([sys.executable, f"scripts/{script}", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    err = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), proc.stderr[-2000:]
    return err[0]


def edited_meta(dist, dst, edit):
    """A copy of torch_dist checkpoint `dist` whose vime_meta.json was edited by hand (`edit(meta)`) and its
    manifest written again for it, as `python -m vime.manifest write` would."""
    shutil.copytree(dist, dst)
    path = os.path.join(dst, "vime_meta.json")
    meta = json.load(open(path))
    with open(path, "w") as f:
        json.dump(edit(meta), f)
    manifest.write_manifest(str(dst))
    return str(dst)


HAND_EDITS = [
    (lambda m: [m], "holds a list, not an object"),
    (lambda m: dict(m, mtp_num_layers="1"), "'mtp_num_layers' is the string \"1\", not an integer"),
    (lambda m: dict(m, model_config=dict(m["model_config"], hidden_size="64")),
     "'model_config.hidden_size' is the string \"64\", not an integer"),
]


@pytest.mark.parametrize("edit, says", HAND_EDITS)
def test_checkpoint_metadata_is_read_as_typed_data(converted, tmp_path, capsys, edit, says):
    hf, dist = converted
    bad = edited_meta(dist, tmp_path / "dist", edit)
    before = contents(bad, hf)
    line = one_line(capsys, torch_dist_to_hf.main, ["--input-dir", bad, "--output-dir", str(tmp_path / "out"),
                                                    "--origin-hf-dir", hf])
    assert line.startswith(f"error: --input-dir {bad}: vime_meta.json: {says}"), line
    assert contents(bad, hf) == before and not os.path.exists(tmp_path / "out")


def test_a_resumed_run_reads_its_checkpoints_metadata_as_typed_data(converted, ckpt, tmp_path, capsys):  # noqa: F811
    """--load of a training checkpoint whose vime_meta.json names its MTP training with a number."""
    _, dist = converted
    iteration = tmp_path / "save" / "iter_0000001"
    edited_meta(dist, iteration / "model", lambda m: dict(m, mtp_trained=1))
    (iteration / LOOP_STATE).write_text(json.dumps({"step": 1, "data_cursor": 0}))
    os.remove(iteration / "model" / "manifest.json")
    manifest.write_manifest(str(iteration))
    (tmp_path / "save" / LATEST).write_text(json.dumps({"step": 1}))
    before = contents(tmp_path / "save")
    line = one_line(capsys, train_rl.main, ["--hf-checkpoint", ckpt, "--load", str(tmp_path / "save"),
                                            "--num-rollout", "3", "--output-dir", str(tmp_path / "out")])
    assert "vime_meta.json: 'mtp_trained' is the integer 1, not true or false" in line, line
    assert contents(tmp_path / "save") == before


def test_a_manifest_is_not_written_over_a_dangling_symbolic_link(tmp_path, capsys):
    (tmp_path / "weights.bin").write_bytes(b"w")
    os.symlink(tmp_path / "gone.bin", tmp_path / "shard.bin")
    line = one_line(capsys, manifest.main, ["write", str(tmp_path)])
    assert line == (f"error: {tmp_path}: shard.bin is a symbolic link to {tmp_path / 'gone.bin'}, which does not "
                    "exist; restore what it points to or remove it, then write the manifest")
    assert sorted(os.listdir(tmp_path)) == ["shard.bin", "weights.bin"]  # no manifest, nothing else


def test_a_binary_file_given_as_a_json_config_is_one_line(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_bytes(bytes(range(256)) * 8)
    before = contents(config)
    line = one_line(capsys, memory_plan.main, ["--hf-config", str(config), "--gpus", "8", "--gpu-memory-gb", "80"])
    assert line == f"error: {config}: not a JSON text file (its bytes are not UTF-8 text: a binary file?)"
    assert contents(config) == before


@pytest.mark.parametrize("flag", ["--load", "--save", "--output-dir", "--prompt-data", "--hf-checkpoint",
                                  "--save-debug-rollout-data"])
def test_an_empty_path_is_refused_by_train_rl(ckpt, tmp_path, capsys, flag):  # noqa: F811
    line = one_line(capsys, train_rl.main, ["--hf-checkpoint", ckpt, "--output-dir", str(tmp_path / "out"), flag, ""])
    assert line == f"error: {flag} '': an empty path names no file; give a path"
    assert not os.path.exists(tmp_path / "out")


def test_an_empty_path_is_refused_by_the_tools(converted, tmp_path, capsys):
    hf, dist = converted
    before = contents(hf, dist)
    for main, argv, flag in [
            (hf_to_torch_dist.main, ["--hf-checkpoint", hf, "--save", ""], "--save"),
            (torch_dist_to_hf.main, ["--input-dir", dist, "--output-dir", "", "--origin-hf-dir", hf], "--output-dir"),
            (torch_dist_to_hf.main, ["--input-dir", "", "--output-dir", str(tmp_path / "o"), "--origin-hf-dir", hf],
             "--input-dir"),
            (memory_plan.main, ["--hf-config", "", "--gpus", "8", "--gpu-memory-gb", "80"], "--hf-config")]:
        assert one_line(capsys, main, argv) == f"error: {flag} '': an empty path names no file; give a path"
    assert one_line(capsys, manifest.main, ["write", ""]) == "error: '': an empty path names no file; give a path"
    assert contents(hf, dist) == before and not os.path.exists(tmp_path / "o")


@pytest.mark.parametrize("script, flags, flag", [
    ("make_eagle3_draft.py", ["--target", QWEN2_TARGET, "--out", "OUT", "--prompt-data", ""], "--prompt-data"),
    ("make_tiny_model.py", ["--out", "OUT", "--init-from", ""], "--init-from"),
    ("make_tiny_model.py", ["--out", "OUT", "--warm-start-from", ""], "--warm-start-from"),
    ("strip_mtp.py", ["--source", QWEN2_TARGET, "--out", ""], "--out"),
    ("export_draft.py", ["--load", "", "--out", "OUT"], "--load"),
])
def test_an_empty_path_is_refused_by_the_scripts(tmp_path, script, flags, flag):
    out = tmp_path / "out"
    line = script_one_line(script, *[out if x == "OUT" else x for x in flags])
    assert line == f"error: {flag} '': an empty path names no file; give a path"
    assert not os.path.exists(out)


def test_a_draft_maker_never_writes_its_draft_over_its_target(tmp_path):
    target = tmp_path / "target"
    shutil.copytree(QWEN2_TARGET, target)
    before = contents(target)
    line = script_one_line("make_eagle3_draft.py", "--target", target, "--out", target)
    assert line == (f"error: --out {target} is --target {target}: writing there would overwrite the input; "
                    "choose another --out")
    line = script_one_line("make_dflash_draft.py", "--target", target, "--out", target / "drafts")
    assert f"--out {target / 'drafts'} lies inside --target {target}" in line
    assert contents(target) == before and not os.path.exists(target / "drafts")


def test_generate_never_writes_over_its_prompts(ckpt, tmp_path, capsys):  # noqa: F811
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+2="}) + "\n")
    before = contents(prompts)
    line = one_line(capsys, generate.main, ["--hf-checkpoint", ckpt, "--prompts", str(prompts), "--output",
                                            str(prompts), "--max-new-tokens", "4"])
    assert f"--output {prompts} is --prompts {prompts}: writing there would overwrite the input" in line
    assert contents(prompts) == before


def test_a_file_given_for_a_directory_is_called_a_file(converted, ckpt, tmp_path, capsys):  # noqa: F811
    hf, dist = converted
    config = os.path.join(hf, "config.json")
    line = one_line(capsys, train_rl.main, ["--hf-checkpoint", ckpt, "--output-dir", str(tmp_path / "out"),
                                            "--load", config])
    assert line == f"error: --load {config}: a file, not a directory"
    line = one_line(capsys, torch_dist_to_hf.main, ["--input-dir", config, "--output-dir", str(tmp_path / "o"),
                                                    "--origin-hf-dir", hf])
    assert line == f"error: --input-dir {config}: a file, not a directory"


def test_a_string_where_a_draft_wants_an_integer_is_called_a_string(tmp_path, capsys):
    draft = tmp_path / "draft"
    shutil.copytree(DFLASH_DRAFT, draft)
    raw = json.loads((draft / "config.json").read_text())
    raw["block_size"] = raw["dflash_config"]["block_size"] = "4"
    (draft / "config.json").write_text(json.dumps(raw))
    before = contents(draft)
    spec = json.dumps({"method": "dflash", "num_speculative_tokens": 3, "model": str(draft)})
    line = one_line(capsys, train_rl.main, ["--hf-checkpoint", QWEN2_TARGET, "--num-rollout", "2", "--output-dir",
                                            str(tmp_path / "out"), "--vllm-speculative-config", spec])
    assert "block_size is the string \"4\"" in line and "an integer" in line, line
    assert contents(draft) == before


def test_a_stage_split_taking_more_layers_than_the_model_has_says_so(ckpt, tmp_path, capsys):  # noqa: F811
    line = one_line(capsys, train_rl.main, ["--hf-checkpoint", ckpt, "--output-dir", str(tmp_path / "out"),
                                            "--pipeline-model-parallel-size", "2",
                                            "--decoder-first-pipeline-num-layers", "3"])
    assert "-1" not in line and "take 3 decoder layers, more than the model's 2" in line, line


DSPARK_DRAFT = os.path.join(REPO, "checkpoints", "tiny-qwen2-dspark")


@pytest.fixture(scope="module")
def headless_dspark(tmp_path_factory):
    """A DSpark draft for the shipped Qwen2 target made without its confidence head (blocks of 3)."""
    out = str(tmp_path_factory.mktemp("headless") / "draft")
    subprocess.run([sys.executable, "scripts/make_dspark_draft.py", "--target", QWEN2_TARGET, "--out", out,
                    "--block-size", "3", "--markov-rank", "8", "--no-confidence-head"], cwd=REPO, check=True,
                   capture_output=True, timeout=600)
    return out


def dspark_spec(draft, **extra):
    return json.dumps({"method": "dspark", "num_speculative_tokens": 3, "model": draft, **extra})


# knobs the run's configuration cannot use: (flags after the target's, what the line says)
IDLE_KNOBS = [
    (lambda headless: ["--vllm-speculative-config", dspark_spec(headless), "--enable-draft-training",
                       "--draft-confidence-weight", "1"],
     "--draft-confidence-weight weighs the confidence head's term, but the draft {headless} has no confidence head"),
    (lambda headless: ["--vllm-speculative-config", dspark_spec(DSPARK_DRAFT), "--enable-draft-training",
                       "--draft-ce-weight", "0", "--draft-l1-weight", "0", "--draft-confidence-weight", "0"],
     "--draft-ce-weight 0, --draft-l1-weight 0, --draft-confidence-weight 0: every term of the loss of the draft"),
    (lambda headless: ["--vllm-speculative-config", dspark_spec(DSPARK_DRAFT, enable_adaptive_verification=True),
                       "--spec-adaptive"],
     "--spec-adaptive and enable_adaptive_verification in --vllm-speculative-config both choose how many drafts"),
    (lambda headless: ["--vllm-speculative-config", dspark_spec(DSPARK_DRAFT), "--rollout-release-kv-cache", "false",
                       "--rollout-release-weights"],
     "--rollout-release-kv-cache false keeps the KV cache, but --rollout-release-weights gives it back"),
]


@pytest.mark.parametrize("flags, says", IDLE_KNOBS)
def test_a_knob_the_runs_configuration_cannot_use_is_one_line(headless_dspark, tmp_path, capsys, flags, says):
    before = contents(DSPARK_DRAFT, headless_dspark, QWEN2_TARGET)
    line = one_line(capsys, train_rl.main, ["--hf-checkpoint", QWEN2_TARGET, "--num-rollout", "2", "--output-dir",
                                            str(tmp_path / "out"), *flags(headless_dspark)])
    assert says.format(headless=headless_dspark) in line, line
    assert contents(DSPARK_DRAFT, headless_dspark, QWEN2_TARGET) == before and not os.path.exists(tmp_path / "out")


def test_the_dspark_draft_maker_refuses_loss_weights_it_cannot_use(tmp_path):
    out = tmp_path / "draft"
    line = script_one_line("make_dspark_draft.py", "--target", QWEN2_TARGET, "--out", out, "--no-confidence-head",
                           "--confidence-weight", "1")
    assert line == ("error: --confidence-weight weighs the confidence head's term, but the draft "
                    "(--no-confidence-head) has no confidence head (enable_confidence_head false): drop the flag")
    line = script_one_line("make_dspark_draft.py", "--target", QWEN2_TARGET, "--out", out, "--ce-weight", "0",
                           "--l1-weight", "0", "--confidence-weight", "0", "--warmup-steps", "2")
    assert line.startswith("error: --ce-weight 0, --l1-weight 0, --confidence-weight 0: every term of the loss"), line
    assert not os.path.exists(out)


@pytest.mark.parametrize("tool, flags", [
    (hf_to_torch_dist.main, lambda hf, dist, tmp: ["--hf-checkpoint", hf, "--save", os.path.join(hf, "dist")]),
    (torch_dist_to_hf.main, lambda hf, dist, tmp: ["--input-dir", dist, "--output-dir", dist, "--origin-hf-dir", hf]),
    (torch_dist_to_hf.main, lambda hf, dist, tmp: ["--input-dir", dist, "--output-dir", hf, "--origin-hf-dir", hf]),
])
def test_a_converter_never_writes_over_its_source(converted, tmp_path, capsys, tool, flags):
    hf, dist = converted
    before = contents(hf, dist)
    line = one_line(capsys, tool, flags(hf, dist, tmp_path))
    assert "writing there would overwrite the input" in line, line
    assert contents(hf, dist) == before


@pytest.mark.parametrize("script, flags", [
    ("make_tiny_model.py", lambda target: ["--init-from", target, "--out", target]),
    ("strip_mtp.py", lambda target: ["--source", target, "--out", target]),
    ("export_draft.py", lambda target: ["--load", target, "--out", os.path.join(target, "draft")]),
    ("make_mtp_draft.py", lambda target: ["--target", target, "--out", target]),
    ("make_dflash_draft.py", lambda target: ["--target", target, "--out", target]),
    ("make_dspark_draft.py", lambda target: ["--target", target, "--out", target]),
])
def test_no_tool_writes_its_output_over_its_input(tmp_path, script, flags):
    target = tmp_path / "target"
    shutil.copytree(QWEN2_TARGET, target)
    before = contents(target)
    line = script_one_line(script, *flags(str(target)))
    assert "writing there would overwrite the input" in line, line
    assert contents(target) == before


def test_the_checkpoint_getter_never_replaces_a_directory_it_did_not_write_or_one_holding_its_input(tmp_path):
    """get_smollm2 replaces --out whole: a directory of other files, or one holding the GGUF file it reads,
    is refused before anything is read or written."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    gguf = mine / "model.gguf"
    gguf.write_bytes(b"GGUF")
    before = contents(mine)
    line = script_one_line("get_smollm2.py", "--gguf", gguf, "--out", mine)
    assert line == (f"error: --out {mine} holds --gguf {gguf}: replacing --out would delete the input; "
                    "choose another --out")
    line = script_one_line("get_smollm2.py", "--gguf", tmp_path / "elsewhere.gguf", "--out", mine)
    assert line == (f"error: --out {mine}: the directory holds files this script did not write (no "
                    "PROVENANCE.json), and --out is replaced whole; choose a new or empty directory")
    assert script_one_line("get_smollm2.py", "--out", "") == "error: --out '': an empty path names no file; give a path"
    assert contents(mine) == before
