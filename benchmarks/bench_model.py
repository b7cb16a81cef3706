"""Cost of the encoder with each positional encoding, plain and with DAPE / DAPE V2, and of
every architecture (the transformer beside CHE's recurrent baselines and plugins' models).

Three parts (run them separately on a busy machine):

* ``train``: one training step (forward + backward + Adam step) at batch 128 and length n = 40,
  the reference training regime; prints wall and CPU time per step and the k1/plain and
  k3/plain ratios.
* ``eval``: one evaluation forward (no gradients, eval mode, chunked by the memory budget) at
  batch 64 for n in --lengths; prints the time and the peak resident memory added by the
  forward (each configuration runs in a fresh process so the peaks do not mix).
* ``architectures``: per architecture (``--architectures``; default every registered one, the
  transformer with ``--pe``), the median training step at batch 128 and n = 40 and the median
  evaluation forward at batch 64 and n = 500 (``--eval-length``), on ``--task`` (default
  reverse_string: n + n model steps), one thread by default. A one-member lstm evaluates with
  torch's fused kernel unless ``--unfused``; ``--members M`` times packs of M.

Use at most as many threads as there are idle cores: on a 2-core machine whose other core is
busy, ``--threads 2`` makes every small parallel op wait for a descheduled thread, which
inflated one evaluation forward (DAPE k = 1, T = 1500) from 45 s to 415 s.

Examples::

    python benchmarks/bench_model.py train --encodings none alibi kerple fire rope
    python benchmarks/bench_model.py eval --encodings kerple --lengths 500 \\
        --tasks duplicate_string
    python benchmarks/bench_model.py architectures
    python benchmarks/bench_model.py architectures --architectures lstm --members 4 --unfused
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import time

import numpy as np
import torch

from che_bench.checks.speed import median_seconds
from che_bench.model.architectures import ARCHITECTURES, TRANSFORMER, build_architecture
from che_bench.model.base import BenchModel
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


def build_for_timing(name: str, args) -> BenchModel:
    torch.manual_seed(0)
    options = {} if name == TRANSFORMER else {"fused": not args.unfused}
    pe = args.pe if name == TRANSFORMER else "none"
    return build_architecture(name, get_task(args.task), pe=pe, members=args.members, **options)


def member_batch(args, n: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of ``args.task`` at length n, the same for every member: ``[M, B, .]``."""
    sample = get_task(args.task).sample(n, batch, np.random.default_rng(0))
    return (torch.from_numpy(sample.inputs.copy()).expand(args.members, -1, -1),
            torch.from_numpy(sample.targets.copy()).expand(args.members, -1, -1))


def architecture_seconds(model: BenchModel, args) -> tuple[float, float]:
    """(training step, evaluation forward) median seconds of ``model``."""
    optimiser = PackOptimizer(model, [1e-3] * args.members, (0.9, 0.999), 1e-8, max_norm=1.0)
    inputs, targets = member_batch(args, args.train_length, args.batch)
    projected = projected_modules(model)
    def step() -> None:
        training_step(model, optimiser, inputs, targets, projected)

    step()  # warm-up
    train = median_seconds(step, args.steps)
    model.eval()
    eval_inputs, _ = member_batch(args, args.eval_length, args.eval_batch)

    def forward() -> None:
        with torch.inference_mode():
            model(eval_inputs)

    forward()  # warm-up
    return train, median_seconds(forward, args.eval_repeats)


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


def run_architectures(args) -> None:
    task = get_task(args.task)
    print(f"{args.task}, {args.members} member(s), {torch.get_num_threads()} thread(s), "
          f"transformer: {args.pe}, {'unfused' if args.unfused else 'fused where possible'}; "
          "median seconds")
    train_shape = f"B{args.batch} T{task.model_length(args.train_length)}"
    eval_shape = f"B{args.eval_batch} T{task.model_length(args.eval_length)}"
    print(f"{'architecture':<12} {'params':>8} {'train step':>11} {'eval fwd':>10}")
    print(f"{'':<12} {'':>8} {train_shape:>11} {eval_shape:>10}")
    for name in args.architectures or list(ARCHITECTURES.names()):
        model = build_for_timing(name, args)
        parameters = sum(p.numel() for p in model.parameters())
        train, evaluation = architecture_seconds(model, args)
        print(f"{name:<12} {parameters // args.members:>8} {train:11.3f} {evaluation:10.2f}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("train", "eval", "architectures"))
    parser.add_argument("--encodings", nargs="+", default=["none", "alibi", "kerple", "fire", "rope"])
    parser.add_argument("--kernels", nargs="+", type=parse_kernel, default=[None, 1, 3],
                        help="none (plain), 1, 3, ... (default: none 1 3)")
    parser.add_argument("--tasks", nargs="+", default=None,
                        help="train default: parity_check (T = 41); eval default: "
                             "duplicate_string missing_duplicate_string")
    parser.add_argument("--threads", type=int, default=None,
                        help="default: 1 for architectures, torch's default otherwise")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--train-length", type=int, default=40)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--eval-batch", type=int, default=64)
    parser.add_argument("--lengths", nargs="+", type=int, default=[100, 250, 500])
    parser.add_argument("--memory-budget", type=int, default=MODEL_DEFAULTS["memory_budget_bytes"])
    architectures = parser.add_argument_group("architectures part")
    architectures.add_argument("--architectures", nargs="+", default=None,
                               help="default: every registered architecture")
    architectures.add_argument("--pe", default="kerple", help="the transformer's encoding")
    architectures.add_argument("--task", default="reverse_string")
    architectures.add_argument("--members", type=int, default=1)
    architectures.add_argument("--unfused", action="store_true")
    architectures.add_argument("--eval-length", type=int, default=500)
    architectures.add_argument("--eval-repeats", type=int, default=1)
    args = parser.parse_args()
    if args.threads is None:
        args.threads = 1 if args.part == "architectures" else torch.get_num_threads()
    torch.set_num_threads(args.threads)
    if args.part == "architectures":
        run_architectures(args)
    elif args.part == "train":
        args.tasks = args.tasks or ["parity_check"]
        run_train(args)
    else:
        args.tasks = args.tasks or ["duplicate_string", "missing_duplicate_string"]
        run_eval(args)


if __name__ == "__main__":
    main()
