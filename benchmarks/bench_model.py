"""Cost of the encoder with each positional encoding, plain and with DAPE / DAPE V2.

Two parts (run them separately on a busy machine):

* ``train``: one training step (forward + backward + Adam step) at batch 128 and length n = 40,
  the reference training regime; prints wall and CPU time per step and the k1/plain and
  k3/plain ratios.
* ``eval``: one evaluation forward (no gradients, eval mode, chunked by the memory budget) at
  batch 64 for n in --lengths; prints the time and the peak resident memory added by the
  forward (each configuration runs in a fresh process so the peaks do not mix).

Use at most as many threads as there are idle cores: on a 2-core machine whose other core is
busy, ``--threads 2`` makes every small parallel op wait for a descheduled thread, which
inflated one evaluation forward (DAPE k = 1, T = 1500) from 45 s to 415 s.

Examples::

    python benchmarks/bench_model.py train --encodings none alibi kerple fire rope
    python benchmarks/bench_model.py eval --encodings kerple --lengths 500 \\
        --tasks duplicate_string
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import time

import numpy as np
import torch

from che_bench.model.encoder import MODEL_DEFAULTS, build_model
from che_bench.tasks import get_task
from che_bench.train.optimizer import PackOptimizer
from che_bench.train.step import projected_modules, training_step


def kernel_label(kernel: int | None) -> str:
    return "plain" if kernel is None else f"k{kernel}"


def parse_kernel(text: str) -> int | None:
    return None if text in ("none", "plain") else int(text)


def time_training_step(task_name: str, pe: str, kernel: int | None, args) -> tuple[float, float]:
    """Median (wall, CPU) seconds of one training step (the step of ``che-bench run``)."""
    task = get_task(task_name)
    torch.manual_seed(0)
    model = build_model(task, pe, kernel)
    optimiser = PackOptimizer(model, [1e-3], (0.9, 0.999), 1e-8, max_norm=1.0)
    projected = projected_modules(model)
    batch = task.sample(args.train_length, args.batch, np.random.default_rng(0))
    inputs, targets = (torch.from_numpy(array)[None] for array in (batch.inputs, batch.targets))

    def step() -> None:
        training_step(model, optimiser, inputs, targets, projected)

    step()  # warm-up
    walls, cpus = [], []
    for _ in range(args.steps):
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _evaluation_in_this_process(task_name, pe, kernel, n, batch_size, budget, threads):
    torch.set_num_threads(threads)
    task = get_task(task_name)
    torch.manual_seed(0)
    model = build_model(task, pe, kernel, memory_budget_bytes=budget).eval()
    inputs = torch.from_numpy(task.sample(n, batch_size, np.random.default_rng(0)).inputs.copy())
    before = _current_rss_bytes()
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        model(inputs)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return wall, cpu, peak - before


def time_evaluation(task_name, pe, kernel, n, args) -> tuple[float, float, int]:
    """(wall s, CPU s, peak bytes above the pre-forward RSS) of one evaluation forward."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(
            _evaluation_in_this_process,
            (task_name, pe, kernel, n, args.eval_batch, args.memory_budget, args.threads),
        )


def run_train(args) -> None:
    print(f"training step: batch {args.batch}, n = {args.train_length}, {args.steps} timed steps, "
          f"{torch.get_num_threads()} thread(s); median per step")
    header = f"{'task':<20} {'encoding':<16} {'kernel':<6} {'wall ms':>9} {'cpu ms':>9} {'cpu/plain':>9}"
    print(header)
    for task_name in args.tasks:
        for pe in args.encodings:
            plain_cpu = None
            for kernel in args.kernels:
                wall, cpu = time_training_step(task_name, pe, kernel, args)
                if kernel is None:
                    plain_cpu = cpu
                ratio = f"{cpu / plain_cpu:9.2f}" if plain_cpu else f"{'-':>9}"
                print(f"{task_name:<20} {pe:<16} {kernel_label(kernel):<6} {wall * 1e3:9.1f} "
                      f"{cpu * 1e3:9.1f} {ratio}", flush=True)


def run_eval(args) -> None:
    print(f"evaluation forward: batch {args.eval_batch}, memory budget "
          f"{args.memory_budget / 2**30:.2f} GiB, {args.threads} thread(s)")
    print(f"{'task':<26} {'n':>4} {'T':>5} {'encoding':<14} {'kernel':<6} {'wall s':>8} "
          f"{'cpu s':>8} {'peak MiB':>9}")
    for task_name in args.tasks:
        task = get_task(task_name)
        for n in args.lengths:
            tokens = task.model_length(n)
            for pe in args.encodings:
                for kernel in args.kernels:
                    wall, cpu, peak = time_evaluation(task_name, pe, kernel, n, args)
                    print(f"{task_name:<26} {n:>4} {tokens:>5} {pe:<14} {kernel_label(kernel):<6} "
                          f"{wall:8.2f} {cpu:8.2f} {peak / 2**20:9.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("train", "eval"))
    parser.add_argument("--encodings", nargs="+", default=["none", "alibi", "kerple", "fire", "rope"])
    parser.add_argument("--kernels", nargs="+", type=parse_kernel, default=[None, 1, 3],
                        help="none (plain), 1, 3, ... (default: none 1 3)")
    parser.add_argument("--tasks", nargs="+", default=None,
                        help="train default: parity_check (T = 41); eval default: "
                             "duplicate_string missing_duplicate_string")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--train-length", type=int, default=40)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--eval-batch", type=int, default=64)
    parser.add_argument("--lengths", nargs="+", type=int, default=[100, 250, 500])
    parser.add_argument("--memory-budget", type=int, default=MODEL_DEFAULTS["memory_budget_bytes"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.part == "train":
        args.tasks = args.tasks or ["parity_check"]
        run_train(args)
    else:
        args.tasks = args.tasks or ["duplicate_string", "missing_duplicate_string"]
        run_eval(args)


if __name__ == "__main__":
    main()
