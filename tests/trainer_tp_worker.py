"""Spawned ranks of the parallel-layout trainer tests (a module so torch.multiprocessing can import it).

`run_layout` is one rank of a trainer group laid out by `layout` (TrainerConfig's parallel sizes):
it takes its data-parallel share of each batch (rows d, d + DP, ...), trains, and rank 0 writes the
metrics, the log-probs of the first batch (its share), the pushed (full HF) weights and, after the
steps, a torch_dist checkpoint of the group.
"""
import torch


def dp_share(samples, dp_rank, dp):
    """The rows data-parallel rank `dp_rank` of `dp` trains on (as the driver splits a step's samples)."""
    return samples[dp_rank::dp]


def run_layout(rank, world, port, layout, hf_dir, ckpt_dir, out_file, cfg_kwargs, seeds, samples=None, load=None):
    """One rank; `samples(seed)` gives a step's samples (default: trainer_fixtures.random_scored_samples);
    `load`: a torch_dist checkpoint to start from (else the HF weights); `ckpt_dir` None: no save."""
    import warnings

    warnings.filterwarnings("ignore")
    from trainer.batch import build_batch
    from trainer.config import TrainerConfig
    from trainer.distributed import init_distributed, teardown
    from trainer.trainer import Trainer
    from trainer_fixtures import random_scored_samples

    samples = samples or (lambda seed: random_scored_samples(seed=seed))
    torch.set_num_threads(1)
    sizes = dict(layout)
    sizes.setdefault("data_parallel_size", world // (layout.get("tensor_model_parallel_size", 1)
                                                     * layout.get("pipeline_model_parallel_size", 1)))
    cfg = TrainerConfig(**sizes, **cfg_kwargs)
    init_distributed(rank, world, "127.0.0.1", port, cfg.layout)
    trainer = Trainer(cfg, hf_dir, load=load)
    dp_rank, dp = cfg.layout.dp_rank(rank), cfg.layout.dp

    def batch(seed):
        return build_batch(dp_share(samples(seed), dp_rank, dp))

    logprobs = trainer.compute_logprobs(batch(seeds[0]))
    metrics = [trainer.train_step(batch(s)) for s in seeds]
    weights = dict(trainer.named_hf_weights())
    if ckpt_dir:
        trainer.save(ckpt_dir)
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights, "logprobs": logprobs}, out_file)
    teardown()


def run_tp2(rank, port, hf_dir, ckpt_dir, out_file, cfg_kwargs, seeds):
    """A rank of TP = 2 over two processes (both ranks train on the whole batch)."""
    run_layout(rank, 2, port, {"tensor_model_parallel_size": 2}, hf_dir, ckpt_dir, out_file, cfg_kwargs, seeds)


def routed_samples(seed, moe_layers, k, num_experts):
    """trainer_fixtures.random_scored_samples with random rollout routes: k distinct experts per (position,
    MoE decoder layer), every position but the last (as a rollout records them)."""
    from trainer_fixtures import random_scored_samples

    samples = random_scored_samples(seed=seed)
    g = torch.Generator().manual_seed(1000 + seed)
    for s in samples:
        positions = len(s.tokens) - 1
        s.routed_experts = torch.stack([torch.randperm(num_experts, generator=g)[:k]
                                        for _ in range(positions * moe_layers)]).view(positions, moe_layers, k)
    return samples
