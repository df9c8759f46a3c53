#!/usr/bin/env python
"""What a checkpoint's manifest costs: writing it against the save it follows, checking it against the
load it precedes, as ratios measured in one run on the shipped models.

    python scripts/bench/checkpoint_manifest.py [--models tiny-mimo-mtp,tiny-glm4-moe-mtp,tiny-deepseek-v3-mtp]

For each model one trainer (MTP training on, so the checkpoint holds the optimizer's moments too) writes
an iteration as `vime.checkpointing.save` does (torch_dist model, loop state, then the manifest: sizes
and SHA-256 of every file) and a new trainer loads it, REPEATS times; the torch_dist write, the
manifest, its check (what `--load` runs) and the trainer's load are timed apart. Medians; the files
are in the page cache on both sides, as they are right after a save.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from trainer.config import TrainerConfig  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402
from vime import checkpointing, manifest  # noqa: E402
from vime.config import REPO_ROOT  # noqa: E402

REPEATS = 5


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def measure(path, cfg, root):
    """[(save s, manifest s, check s, load s, checkpoint bytes)] of REPEATS saves and loads under root."""
    trainer = Trainer(cfg, path)
    rows = []
    for rep in range(REPEATS):
        iteration = os.path.join(root, f"iter_{rep + 1:07d}")  # what checkpointing.save writes, in its order
        save, _ = timed(trainer.save, os.path.join(iteration, "model"))
        with open(os.path.join(iteration, checkpointing.LOOP_STATE), "w") as f:
            f.write('{"step": %d, "data_cursor": 0}' % (rep + 1))
        write, _ = timed(manifest.write_manifest, iteration)
        check, problem = timed(manifest.manifest_problem, iteration)
        assert problem is None, problem
        load, _ = timed(Trainer, cfg, path, os.path.join(iteration, "model"))
        size = sum(os.path.getsize(os.path.join(iteration, f)) for f in manifest.files_under(iteration))
        rows.append((save, write, check, load, size))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny-mimo-mtp,tiny-glm4-moe-mtp,tiny-deepseek-v3-mtp")
    args = p.parse_args()
    print("| model | checkpoint | save (torch_dist) | + manifest | manifest / save | load | check | check / load |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        path = os.path.join(REPO_ROOT, "checkpoints", name)
        root = tempfile.mkdtemp(prefix="vime-manifest-")
        try:
            rows = measure(path, TrainerConfig(enable_mtp_training=True, mtp_num_layers=1), root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        save, man, check, load = (statistics.median(r[i] for r in rows) for i in range(4))
        mib = rows[0][4] / 2 ** 20
        print(f"| {name} | {mib:.1f} MiB | {save * 1e3:.0f} ms | {man * 1e3:.1f} ms | {man / save:.3f} | "
              f"{load * 1e3:.0f} ms | {check * 1e3:.1f} ms | {check / load:.3f} |")


if __name__ == "__main__":
    main()
