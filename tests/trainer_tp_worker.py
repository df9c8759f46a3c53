"""Spawned ranks of the parallel-layout trainer tests (a module so torch.multiprocessing can import it)."""
import torch


def run_layout(rank, layout, port, hf_dir, load, ckpt_dir, out_file, cfg_kwargs, seeds, batch_kwargs=None):
    """One rank of `layout` (a ParallelLayout) on `hf_dir`, resumed from the torch_dist checkpoint `load`
    (None: from the HF weights): log-probs of seeds[0]'s batch, a train step per seed (batches of
    `make_batch(seed, **batch_kwargs)`), the pushed weights, a torch_dist save into `ckpt_dir`; rank 0
    writes what it got to `out_file`."""
    import warnings

    warnings.filterwarnings("ignore")
    from trainer.config import TrainerConfig
    from trainer.distributed import init_distributed, teardown
    from trainer.trainer import Trainer
    from trainer_fixtures import make_batch

    torch.set_num_threads(1)
    init_distributed(rank, layout.world_size, "127.0.0.1", port, layout)
    trainer = Trainer(TrainerConfig(**layout.config_fields(), **cfg_kwargs), hf_dir, load=load)
    batch_kwargs = batch_kwargs or {}
    logprobs = trainer.compute_logprobs(make_batch(seed=seeds[0], **batch_kwargs))
    metrics = [trainer.train_step(make_batch(seed=s, **batch_kwargs)) for s in seeds]
    weights = dict(trainer.named_hf_weights())
    trainer.save(ckpt_dir)
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights, "logprobs": logprobs}, out_file)
    teardown()
