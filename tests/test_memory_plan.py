"""The memory plan (vime/models/memory_plan.py, its command line vime/memory_plan.py): its parameter counts against the published model sizes and
against what the trainer's megatron ranks really hold, its bytes against the trainer's own optimizer, and
its one-line refusals."""
import dataclasses
import json
import math
import re
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from rollout.tiny_model import tiny_config
from vime.models.families import to_canonical
from vime.errors import UserError
from vime.models.hf_format import expected_hf_tensors, read_config
from vime.memory_plan import PRESETS, main, read_model_config
from vime.models.memory_plan import HOST_STATE, MemoryPlanner, PlanOptions, pipeline_splits, stage_bytes
from vime.models.rank_params import RankParams
from vime.models.tensor_check import safetensors_shapes, tensor_mismatch
from vime.net import free_port
from vime.parallel_layout import ParallelLayout
from rank_count_worker import count_models, run_counts

GLM = "configs/models/glm-4.7/config.json"
DEEPSEEK = "configs/models/deepseek-v3/config.json"
SHIPPED = ("tiny-mimo-mtp", "tiny-qwen2", "tiny-glm4-moe-mtp", "tiny-deepseek-v3-mtp")
B = 1e9


def within_rounding(count, published_billions):
    """`count` parameters round to the published figure (given in whole billions)."""
    return abs(count / B - published_billions) <= 0.5


def totals(path):
    cfg, _ = read_model_config(path)
    trunk, mtp = RankParams(cfg, cfg.num_nextn_predict_layers).totals()
    return cfg, trunk, mtp


@pytest.mark.parametrize("name", SHIPPED)
def test_the_format_the_plan_counts_is_the_shipped_checkpoints_tensor_for_tensor(name):
    """expected_hf_tensors (what the plan counts) names every tensor of each shipped checkpoint with its shape; the
    checkpoints are the ones transformers and vLLM load in the engine tests."""
    path = f"checkpoints/{name}"
    cfg = read_config(path)
    held = {n: torch.empty(s, device="meta") for n, s in safetensors_shapes(f"{path}/model.safetensors").items()}
    canonical = to_canonical(held, cfg.model_family.mtp_layout, cfg.num_hidden_layers, cfg.num_nextn_predict_layers)
    assert tensor_mismatch(expected_hf_tensors(cfg), {n: t.shape for n, t in canonical.items()}) is None


def test_glm_4_7_counts_the_published_355b_and_the_hubs_358b():
    """zai-org publishes GLM-4.5 (whose architecture GLM-4.7 keeps) as 355 B parameters, 32 B activated: both hold
    for every parameter but the word embedding and the output layer, the MTP layer included. The Hugging Face
    hub counts the stored zai-org/GLM-4.7 files as 358 B: they add the MTP layer's own copies of the two."""
    cfg, trunk, mtp = totals(GLM)
    embedding = cfg.vocab_size * cfg.hidden_size
    body = trunk.elements + mtp.elements - 2 * embedding
    routed = trunk.expert_params + mtp.expert_params
    idle = routed * (1 - cfg.moe.num_experts_per_tok / cfg.moe.n_routed_experts)  # experts a token does not use
    assert within_rounding(body, 355)
    assert within_rounding(body - idle, 32)
    assert within_rounding(trunk.elements + mtp.elements + 2 * embedding, 358)


def fp8_block_scales(cfg):
    """Elements of DeepSeek-V3's fp8 block scales: one fp32 per 128 x 128 block of every projection of a decoder
    layer (`weight_scale_inv`); embeddings, norms, routers and the MTP layer's own tensors stay bf16."""
    return sum(math.ceil(e.shape[0] / 128) * math.ceil(e.shape[1] / 128) for n, e in expected_hf_tensors(cfg).items()
               if re.search(r"\.(self_attn|mlp)\..*_proj\.weight$", n))


def test_deepseek_v3_counts_the_published_671b_and_685b():
    """DeepSeek publishes the main model as 671 B parameters (embedding and output head included) and the
    hub's stored files as 685 B = 671 B + 14 B of the MTP module, which stores its own copies of the embedding
    and the head; the hub counts every stored tensor, the fp8 block scales too."""
    cfg, trunk, mtp = totals(DEEPSEEK)
    assert within_rounding(trunk.elements, 671)
    stored = trunk.elements + mtp.elements + 2 * cfg.vocab_size * cfg.hidden_size + fp8_block_scales(cfg)
    assert within_rounding(stored, 685)


def glm_moe_layer_params(raw, ep):
    """Parameters one rank holds of one GLM-4.7 MoE decoder layer at EP `ep`, from config.json's numbers."""
    h, heads, kv, d = raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    experts, width = raw["n_routed_experts"], raw["moe_intermediate_size"]
    attention = 2 * h * heads * d + 2 * h * kv * d + (heads + 2 * kv) * d + 2 * d  # q, o; k, v; biases; q/k norm
    mlp = h * experts + 3 * h * width * (experts // ep + raw["n_shared_experts"])  # router, routed + shared
    return attention + 2 * h + mlp  # + the two layer norms


def test_a_layout_that_does_not_fit_is_refused_in_one_line_with_its_numbers(capsys):
    """GLM-4.7 at TP 1, PP 8 (12 | 6 x 12 | 8 layers) and EP 8 on 64 GPUs, --bf16: a middle stage holds 12 MoE layers,
    each parameter 2 (bf16) + 4 (fp32 main) + 4 (fp32 gradient) + 8 (Adam) bytes, each correction bias 4."""
    raw = json.load(open(GLM))
    params = 12 * glm_moe_layer_params(raw, ep=8)
    total = params * (2 + 4 + 4 + 8) + 12 * raw["n_routed_experts"] * 4
    with pytest.raises(SystemExit) as exit_:
        main(["--hf-config", GLM, "--gpus", "64", "--gpu-memory-gb", "80", "--bf16", "--enable-mtp-training",
              "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "8", "--expert-model-parallel-size", "8",
              "--decoder-first-pipeline-num-layers", "12", "--decoder-last-pipeline-num-layers", "8"])
    out = capsys.readouterr()
    assert exit_.value.code == 2 and out.out == ""
    assert out.err.count("\n") == 1 and out.err.startswith("error: ")
    assert f"needs {total / B:.1f} GB per rank on pipeline stage 1" in out.err
    assert "more than --gpu-memory-gb 80" in out.err


@pytest.mark.parametrize("argv, needle", [
    (["--hf-config", GLM, "--expert-model-parallel-size", "3", "--gpus", "96"], "does not divide the model's 160 "
     "routed experts"),
    (["--hf-config", GLM, "--expert-model-parallel-size", "32", "--pipeline-model-parallel-size", "4"],
     "does not divide the 16 trainer ranks of a pipeline stage"),
    (["--hf-config", GLM, "--tensor-model-parallel-size", "2"], "mixture-of-experts models"),
    (["--hf-config", GLM, "--pipeline-model-parallel-size", "3"], "--gpus 64 is not a multiple"),
    (["--hf-config", GLM, "--pipeline-model-parallel-size", "128", "--gpus", "128"], "more stages than its 92"),
    (["--hf-config", GLM, "--pipeline-model-parallel-size", "8", "--decoder-first-pipeline-num-layers", "10"],
     "leave 82 of the model's 92 decoder layers for the other 7"),
    (["--hf-config", GLM, "--decoder-last-pipeline-num-layers", "10"], "--pipeline-model-parallel-size 2 or more"),
    (["--hf-config", "checkpoints/tiny-mimo-mtp", "--expert-model-parallel-size", "2"], "is a dense model"),
    (["--hf-config", "checkpoints/tiny-mimo-mtp", "--tensor-model-parallel-size", "8"], "does not divide the model's 4 "
     "attention heads"),
    (["--hf-config", GLM, "--gpu-memory-gb", "40"], "none of the"),
    (["--hf-config", "no/such/config.json"], "no such file"),
    (["--hf-config", GLM, "--mtp-num-layers", "2"], "has only 1 MTP layers"),
    (["--hf-config", GLM, "--gpus", "0"], "--gpus 0: must be >= 1"),
])
def test_each_refusal_is_one_line_naming_what_to_change(capsys, argv, needle):
    defaults = {"--gpus": "64", "--gpu-memory-gb": "80"}
    argv = argv + [x for k, v in defaults.items() if k not in argv for x in (k, v)]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert needle in err, err


def test_a_config_of_an_unsupported_family_is_refused_in_one_line(tmp_path, capsys):
    neox = tmp_path / "config.json"
    neox.write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": 32000,
                                 "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                                 "num_attention_heads": 32}))
    with pytest.raises(SystemExit) as exit_:
        main(["--hf-config", str(neox), "--gpus", "8", "--gpu-memory-gb", "80"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "GPTNeoXForCausalLM" in err and "not a supported model family" in err


def test_the_command_lists_the_layouts_that_fit_and_says_what_it_does_not_count():
    """`python -m vime.models.memory_plan` as docs/at_scale.md runs it: GLM-4.7 on 128 GPUs of 80 GB."""
    run = subprocess.run([sys.executable, "-m", "vime.memory_plan", "--hf-config", GLM, "--gpus", "128",
                          "--gpu-memory-gb", "80", "--bf16", "--enable-mtp-training"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    # TP SP PP CP EP ETP DP ... free GB tokens
    rows = [line.split() for line in run.stdout.splitlines() if re.match(r"\s*\d+\s+(yes|no)\s+\d+\s+1\s", line)]
    assert rows and all(float(r[-2]) >= 0 and int(r[0]) * int(r[2]) * int(r[6]) == 128 for r in rows)
    assert all((r[1] == "yes") == (int(r[0]) > 1) for r in rows)  # a MoE layer splits over TP with SP only
    assert "not counted: the rollout engines" in run.stdout


def test_pipeline_stages_hold_every_parameter_once_plus_megatrons_copies():
    """Summed over stages (TP = EP = 1), the ranks hold the whole model, plus, with PP > 1, the last stage's
    output layer of a tied model and the MTP layers' word embedding (megatron-core's GPTModel)."""
    for cfg in (tiny_config("glm4_moe"), dataclasses.replace(tiny_config("mimo"), tie_word_embeddings=True)):
        params = RankParams(cfg, 1)
        trunk, mtp = params.totals()
        embedding = cfg.vocab_size * cfg.hidden_size
        for pp, split in ((1, (None, None)), (2, (None, 2)), (3, (1, 3))):
            layout = ParallelLayout(pp=pp, first_stage_layers=split[0], last_stage_layers=split[1])
            layout.check_split(cfg)
            held = sum(s.total.elements for s in params.stages(layout))
            copies = (pp > 1) * embedding * (1 + cfg.tie_word_embeddings)
            assert held == trunk.elements + mtp.elements + copies, (cfg.family, pp)


def test_the_split_search_tries_exactly_the_splits_the_layout_rules_accept():
    for layers, pp in ((7, 2), (9, 3), (10, 4), (8, 5), (6, 3)):
        cfg = dataclasses.replace(tiny_config("mimo"), num_hidden_layers=layers)
        accepted = set()
        for split in [(None, None)] + [(f, last) for f in range(1, layers) for last in range(1, layers)]:
            try:
                ParallelLayout(pp=pp, first_stage_layers=split[0], last_stage_layers=split[1]).check_split(cfg)
            except UserError:
                continue
            accepted.add(split)
        # a split that gives the last stage the even share names the same stages as one without it
        assert set(pipeline_splits(layers, pp)) == {s for s in accepted if None not in s or s == (None, None)}


DENSE = {"qwen3 (q/k norm)": tiny_config("qwen3"),
         "mimo tied (q/k/v bias)": dataclasses.replace(tiny_config("mimo"), tie_word_embeddings=True)}
MOE = {"glm4_moe": tiny_config("glm4_moe"), "deepseek_v3 (MLA)": tiny_config("deepseek_v3")}


def assert_plan_counts(counts, cfgs, layout):
    """Each rank's parameters, checkpoint buffers and their fp32 / bf16 bytes are the plan's for its stage."""
    for name, cfg in cfgs.items():
        params = RankParams(cfg, cfg.num_nextn_predict_layers, counts["spec"])
        layout.check_split(cfg)
        stage = params.stages(layout)[counts["pp_rank"]]
        for dtype, got in counts[name].items():
            options = PlanOptions(bf16=dtype == str(torch.bfloat16))
            assert (got["params"], got["buffers"]) == (stage.total.params, stage.total.buffers), (name, dtype)
            assert got["bytes"] == stage_bytes(stage, options, layout).weights, (name, dtype)


def test_each_tensor_parallel_rank_holds_what_the_plan_counts(tmp_path):
    """TP = 2 over two gloo processes, the megatron models built by trainer/model.py (dense families: MoE
    trains at TP 1)."""
    layout = ParallelLayout(tp=2)
    mp.spawn(run_counts, args=(2, free_port(), layout, DENSE, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert_plan_counts(torch.load(tmp_path / f"rank{rank}.pt"), DENSE, layout)


def test_a_mixture_of_experts_rank_holds_what_the_plan_counts():
    """GLM-4.5 (GQA) and DeepSeek-V3 (MLA) MoE with their MTP layer, as the trainer builds them at TP 1."""
    from trainer.distributed import owned_single_process

    with owned_single_process():
        counts = count_models(MOE, ParallelLayout())
    assert_plan_counts(counts, MOE, ParallelLayout())


@pytest.mark.slow  # two processes building both models (about 20 s on 2 cores)
def test_each_sequence_parallel_rank_of_a_moe_model_holds_what_the_plan_counts(tmp_path):
    """TP = 2 with sequence parallelism and EP = 2 (ETP 1) over two gloo processes: megatron-core splits the MoE
    models' attention and shared experts over TP and their routed experts over EP, as the plan counts."""
    layout = ParallelLayout(tp=2, sp=True, ep=2, etp=1)
    mp.spawn(run_counts, args=(2, free_port(), layout, MOE, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert_plan_counts(torch.load(tmp_path / f"rank{rank}.pt"), MOE, layout)


@pytest.mark.slow  # two processes building both models (about 20 s on 2 cores)
def test_each_expert_parallel_rank_holds_what_the_plan_counts(tmp_path):
    """EP = 2 over two gloo processes: each rank builds its half of the routed experts (trunk and MTP layer)
    through trainer/model.py and holds what the plan counts for it."""
    layout = ParallelLayout(dp=2, ep=2)
    mp.spawn(run_counts, args=(2, free_port(), layout, MOE, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        counts = torch.load(tmp_path / f"rank{rank}.pt")
        assert counts["ep_rank"] == rank
        assert_plan_counts(counts, MOE, layout)


OPTIONS = {  # the trainer's settings -> the plan's options: every option that changes what a rank holds
    "fp32": ({}, PlanOptions()),
    "bf16-mtp": ({"bf16": True, "enable_mtp_training": True}, PlanOptions(bf16=True, train_mtp=True)),
    "distributed": ({"bf16": True, "use_distributed_optimizer": True},
                    PlanOptions(bf16=True, distributed_optimizer=True)),
    "cpu-offload-half": ({"bf16": True, "use_distributed_optimizer": True, "optimizer_cpu_offload": True,
                          "optimizer_offload_fraction": 0.5},
                         PlanOptions(bf16=True, distributed_optimizer=True, cpu_offload=True, offload_fraction=0.5)),
    "precision-aware-offload": ({"bf16": True, "use_distributed_optimizer": True, "optimizer_cpu_offload": True,
                                 "use_precision_aware_optimizer": True, "main_grads_dtype": "bf16"},
                                PlanOptions(bf16=True, distributed_optimizer=True, cpu_offload=True, precision_aware=True,
                                            main_grads_dtype="bf16")),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_the_plans_gradients_and_optimizer_state_are_what_the_trainer_allocates(name):
    """One train step of the trainer on the shipped GLM-4.5 MoE model with each option; then its gradient buffers,
    its device optimizer state and its host optimizer state take the bytes the plan counts. A frozen MTP layer has
    none of them. megatron's HybridDeviceOptimizer offloads whole parameters until it has its fraction of the
    elements, so the host may hold up to one parameter more than the exact fraction (and the device one less)."""
    from trainer.config import TrainerConfig
    from trainer.optimizer import held_bytes
    from trainer.trainer import Trainer
    from trainer_fixtures import make_batch

    settings, options = OPTIONS[name]
    path = "checkpoints/tiny-glm4-moe-mtp"
    trainer = Trainer(TrainerConfig(micro_batch_size=4, **settings), path)
    trainer.train_step(make_batch(n=8, seed=0))
    held = held_bytes(trainer.model, trainer.parts)
    grads, device, host = held["gradients"], held["optimizer"], held["optimizer_host"]

    plan = MemoryPlanner(read_config(path), options, spec=counts_spec()).plan(ParallelLayout()).bytes[0]
    largest = max(p.numel() for p in trainer.model.parameters())
    slack = largest * HOST_STATE if options.cpu_offload else 0
    assert (held["weights"], grads) == (plan.weights, plan.gradients)
    assert abs(host - plan.host) <= slack and abs(device - plan.optimizer) <= slack
    assert (host > 0) == options.cpu_offload


def counts_spec():
    from trainer.model import spec_name

    return spec_name()


def test_a_layout_the_plan_lists_is_one_the_trainer_runs():
    """A PP 2 x EP 2 layout of the GLM-4.5 model: megatron-core can split the model so (the plan lists it), and
    the trainer's pre-start check takes it (test_trainer_tensor_parallel.py runs it)."""
    cfg = read_config("checkpoints/tiny-glm4-moe-mtp")
    layout = ParallelLayout(pp=2, dp=2, ep=2, last_stage_layers=2)
    layout.check_split(cfg)
    layout.check_model(cfg)


# ---- the published layouts (presets), --layout, and the options that change activations -----------------


def plan_output(capsys, *argv):
    main(list(argv))
    return capsys.readouterr().out


@pytest.mark.parametrize("preset", ["slime-glm-4.7", "slime-deepseek-r1"])
def test_slimes_layouts_fit_their_gpus_with_cpu_adam_and_say_what_the_host_holds(capsys, preset):
    """slime runs GLM-4.7 on 64 and DeepSeek-R1 on 128 H100s of 80 GB at TP 8 (SP) x PP 4 x CP x EP with CPU Adam: the
    plan says they fit, at slime's 16384 tokens per micro-batch too, and prints CPU Adam's host memory per node (16 B
    per parameter of a rank's shard, 8 ranks a node); without CPU Adam the same layout does not fit."""
    out = plan_output(capsys, "--preset", preset)
    assert "\nfits: " in out and "at 16384 tokens per micro-batch" in out and "GB: fits" in out
    host = re.search(r"host: CPU Adam keeps ([0-9.]+) GB per rank, ([0-9.]+) GB per node of 8 GPUs", out)
    # each printed to 0.1 GB: the node's is 8 times the rank's within their roundings
    assert host and float(host.group(2)) == pytest.approx(8 * float(host.group(1)), abs=8 * 0.05 + 0.05)
    without = re.search(r"without CPU Adam the fullest stage \(\w+\) would need ([0-9.]+) GB", out)
    assert without and float(without.group(1)) > 80
    with pytest.raises(SystemExit) as exit_:  # the negative control: the optimizer's state on the GPUs
        main([a for a in PRESETS[preset].argv if a != "--optimizer-cpu-offload"])
    assert exit_.value.code == 2 and "more than --gpu-memory-gb 80" in capsys.readouterr().err


def test_verl_and_nemo_rls_deepseek_v3_layout_fits_256_gpus_without_cpu_adam(capsys):
    out = plan_output(capsys, "--preset", "verl-deepseek-v3")
    assert "TP 1 x PP 16 x DP 16 (EP 16, ETP 1)" in out and "\nfits: " in out and "GB: fits" in out
    assert "host: no CPU Adam" in out and "GB per node of 8 GPUs" in out


def test_megatron_bridges_deepseek_v3_recipe_fits_with_bf16_moments_and_gradients(capsys):
    out = plan_output(capsys, "--preset", "megatron-bridge-deepseek-v3")
    assert "gradient 2 B + Adam moments 4 B" in out and "\nfits: " in out and "GB: fits" in out


@pytest.mark.parametrize("layout, needle", [
    ("tp=8,xx=2", "'xx' is not a layout size"),
    ("tp=8,pp=two", "pp needs a whole number >= 1"),
    ("tp=1,sp", "--sequence-parallel splits the sequence over the tensor-parallel ranks"),
    ("tp=8,pp=4,cp=2,ep=16,etp=1", "only with sequence parallelism: add --sequence-parallel"),
    ("tp=8,sp,pp=3", "--gpus 64 is not a multiple"),
])
def test_a_layout_string_is_refused_in_one_line_naming_what_to_change(capsys, layout, needle):
    with pytest.raises(SystemExit) as exit_:
        main(["--hf-config", GLM, "--gpus", "64", "--gpu-memory-gb", "80", "--layout", layout])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and needle in err, err


def test_a_preset_takes_overrides_and_the_options_follow_the_trainers_rules(capsys):
    out = plan_output(capsys, "--preset", "slime-glm-4.7", "--gpu-memory-gb", "141")
    assert "64 GPUs of 141 GB" in out
    with pytest.raises(SystemExit):
        main(["--hf-config", GLM, "--gpus", "64", "--gpu-memory-gb", "80", "--optimizer-cpu-offload", "--bf16"])
    assert "--optimizer-cpu-offload steps the distributed optimizer's shards on the host" in capsys.readouterr().err


def test_the_activations_full_recompute_keeps_are_the_layer_inputs_the_trainer_keeps():
    """--recompute-granularity full --recompute-method uniform --recompute-num-layers N: the trainer's decoder keeps
    for its backward pass only each chunk's input (megatron's checkpoint), one hidden state per token and chunk; the
    plan counts that. Read off autograd's saved tensors per token (one more row of 64 tokens), outside the weights."""
    from trainer.config import TrainerConfig
    from trainer.model import forward
    from trainer.trainer import Trainer
    from vime.models.activations import RecomputePlan, Split, stage_activations

    path = "checkpoints/tiny-qwen2"
    cfg = read_config(path)
    for n in (1, 7):
        trainer = Trainer(TrainerConfig(recompute_granularity="full", recompute_method="uniform",
                                        recompute_num_layers=n), path)
        trainer.model.train()
        per_row = {}
        for rows in (1, 2):
            tokens = torch.randint(0, cfg.vocab_size, (rows, 64), generator=torch.Generator().manual_seed(0))
            per_row[rows] = saved_activation_bytes(trainer.model.decoder, lambda: forward(trainer.model, tokens),
                                                   outside=trainer.model.decoder.final_layernorm)
        kept = stage_activations(cfg, range(cfg.num_hidden_layers), Split(), "local", 64, 4,
                                 RecomputePlan("full", "uniform", n)).kept
        assert (per_row[2] - per_row[1]) / 64 == kept


def saved_activation_bytes(module, run, outside):
    """Bytes of the distinct storages autograd saves for the backward pass while `module` runs inside `run()`,
    its parameters and what its submodule `outside` saves left out."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    inside, saved = [False], {}

    def pack(t):
        storage = t.untyped_storage()
        if inside[0] and storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    hooks = [module.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True)),
             module.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False)),
             outside.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, False)),
             outside.register_forward_hook(lambda m, a, o: inside.__setitem__(0, True))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    for hook in hooks:
        hook.remove()
    return sum(saved.values())
