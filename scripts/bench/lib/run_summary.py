"""One line for a train_rl.py run's metrics (scripts/gpu_check.sh prints it):

    python -m scripts.bench.lib.run_summary runs/gpu_check/main      # the run's --output-dir

steps, reward and acceptance length at the first and last step, the mean step time from step 1 on
(step 0 holds the warm-up), how many engines took the weights in place, and each phase's memory as
logged (the largest over the steps).
"""
import statistics
import sys

from scripts.bench.lib.arm_runs import read_metrics


def summary(rows):
    """The line for a run's metric rows."""
    first, last = rows[0], rows[-1]
    step_time = statistics.fmean(r["perf/step_time"] for r in rows[1:]) if len(rows) > 1 else first["perf/step_time"]
    memory = sorted({k for r in rows for k in r if k.startswith("memory/")})
    cells = [f"{len(rows)} steps", f"reward {first['rollout/reward']:.3f} -> {last['rollout/reward']:.3f}",
             f"accept length {first.get('rollout/spec_accept_length', 1.0):.3f} -> "
             f"{last.get('rollout/spec_accept_length', 1.0):.3f}",
             f"step {step_time:.2f} s", f"in-place engines {last.get('weight_sync/in_place_engines', 0)}"]
    cells += [f"{k.removeprefix('memory/')} {max(r.get(k, 0.0) for r in rows):.2f}" for k in memory]
    return ", ".join(cells)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    rows = read_metrics(argv[0])
    print(summary(rows) if rows else f"no steps logged in {argv[0]}")


if __name__ == "__main__":
    main()
