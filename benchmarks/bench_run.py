"""Timing of `che-bench run` on this machine.

1. A real ``quick``-preset run (train + evaluate) of one configuration, default
   missing_duplicate / Kerple / DAPE V2 kernel 3.
2. An ESTIMATE of the full paper evaluation (every length 41..500, 512 sequences each in
   sub-batches of 64) of one paper-sized model: a few lengths are timed for real, the cost
   a + b*T + c*T^2 (T = model input length) is fitted and summed over 41..500. The model is
   untrained: evaluation cost does not depend on the weights.

    .venv/bin/python benchmarks/bench_run.py [--task T --pe P --kernel K] [--threads N]
        [--skip-quick] [--skip-estimate]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from che_bench.config import make_config
from che_bench.eval.evaluation import length_accuracies
from che_bench.model.encoder import build_model
from che_bench.run.runner import execute_run


def time_quick_run(task: str, pe: str, kernel: int | None) -> None:
    config = make_config(task, pe, kernel, "quick")
    result = execute_run(config, device="cpu", progress=False)
    t = result.timings
    print(f"quick preset, {task} / {pe} / kernel {kernel}: {config.steps} steps, batch "
          f"{config.batch_size}, {config.model_options['layers']} layers, "
          f"{len(config.test_lengths)} test lengths x {config.eval_samples} sequences")
    print(f"  status {result.status}; train {t['train_s']:.1f} s ({t['steps_per_s']:.1f} steps/s), "
          f"eval {t.get('eval_s', float('nan')):.1f} s, total {t['total_s']:.1f} s")
    if result.status == "complete":
        print(f"  in-distribution accuracy {result.train_accuracy:.1%}, "
              f"score (mean over test lengths) {result.score:.1%}")
    else:
        print(f"  error: {result.error}")


def estimate_paper_eval(task_name: str, pe: str, kernel: int | None, lengths: list[int]) -> None:
    config = make_config(task_name, pe, kernel, "paper")
    task = config.build_task()
    torch.manual_seed(0)
    model = build_model(task, pe=config.pe, kernel=config.kernel, **config.model_kwargs())
    model.eval()
    device = torch.device("cpu")
    tokens, seconds = [], []
    for n in lengths:
        started = time.perf_counter()
        length_accuracies(model, task, config, n, device)
        seconds.append(time.perf_counter() - started)
        tokens.append(task.model_length(n))
        print(f"  measured: n={n} (T={tokens[-1]}), {config.eval_samples} sequences: "
              f"{seconds[-1]:.1f} s")
    design = np.array([[1.0, t, t * t] for t in tokens])
    coefficients = np.linalg.lstsq(design, np.array(seconds), rcond=None)[0]
    all_tokens = [task.model_length(n) for n in config.test_lengths]
    total = sum(float(np.dot(coefficients, [1.0, t, t * t])) for t in all_tokens)
    print(f"  EXTRAPOLATION (fit a + b*T + c*T^2 to the lengths above, summed over "
          f"{len(all_tokens)} lengths 41..500): ~{total / 3600:.1f} h for one model on this CPU "
          f"({torch.get_num_threads()} threads)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="missing_duplicate")
    parser.add_argument("--pe", default="kerple")
    parser.add_argument("--kernel", type=int, default=3)
    parser.add_argument("--lengths", default="100,250,500", help="lengths timed for the estimate")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, as `che-bench run`)")
    parser.add_argument("--skip-quick", action="store_true")
    parser.add_argument("--skip-estimate", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.skip_quick:
        time_quick_run(args.task, args.pe, args.kernel)
    if not args.skip_estimate:
        print(f"paper-protocol evaluation, {args.task} / {args.pe} / kernel {args.kernel}, "
              "paper-size model (5 layers, width 64):")
        estimate_paper_eval(args.task, args.pe, args.kernel, [int(n) for n in args.lengths.split(",")])


if __name__ == "__main__":
    main()
