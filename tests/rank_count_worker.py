"""Spawned ranks of the per-rank parameter-count test (a module so torch.multiprocessing can import it).

Each rank builds megatron-core models through the trainer's own code (trainer/model.py) and records
what it holds: the elements of its parameters and of the buffers that are checkpoint weights, and
their bytes in fp32 and in bf16, with the rank's place in the layout (its pipeline and expert ranks).
"""
import torch


def held(model):
    """{"params", "buffers", "bytes"} of what `model` holds on this rank."""
    from vime.models.megatron_names import SYNCED_BUFFERS

    params = list(model.parameters())
    buffers = [b for n, b in model.named_buffers() if n.endswith(SYNCED_BUFFERS)]
    return {"params": sum(p.numel() for p in params), "buffers": sum(b.numel() for b in buffers),
            "bytes": sum(t.numel() * t.element_size() for t in params + buffers)}


def count_models(cfgs, layout):
    """{name: {dtype name: held(...)}, "spec", "pp_rank", "ep_rank"} of models `cfgs` ({name: ModelConfig}) built
    as `layout` (a ParallelLayout) on this rank."""
    from megatron.core import parallel_state as ps

    from trainer.model import build_model, spec_name

    out = {"spec": spec_name(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
           "ep_rank": ps.get_expert_model_parallel_rank()}
    for name, cfg in cfgs.items():
        out[name] = {str(dtype): held(build_model(cfg, cfg.num_nextn_predict_layers, layout, params_dtype=dtype))
                     for dtype in (torch.float32, torch.bfloat16)}
    return out


def run_counts(rank, world_size, port, layout, cfgs, out_dir):
    import warnings

    warnings.filterwarnings("ignore")
    from trainer.distributed import init_distributed, teardown

    torch.set_num_threads(1)
    init_distributed(rank, world_size, "127.0.0.1", port, layout)
    torch.save(count_models(cfgs, layout), f"{out_dir}/rank{rank}.pt")
    teardown()
