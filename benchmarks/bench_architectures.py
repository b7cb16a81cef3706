"""Cost of CHE's recurrent baselines (``che_bench.model.recurrent``) on this CPU.

For each architecture: the median time of one training step (forward + backward + clipped
Adam, ``che_bench.train.loop.training_step``) at batch 128 and n = 40, and of one evaluation
forward (no gradients, eval mode) at batch 64 and n = 500. One thread by default. A
one-member rnn/lstm runs torch's fused kernel unless ``--unfused``.

Example::

    python benchmarks/bench_architectures.py --task reverse_string
    python benchmarks/bench_architectures.py --architectures lstm --members 4 --unfused
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from che_bench.model.recurrent import ARCHITECTURES, build_recurrent
from che_bench.tasks import get_task
from che_bench.train.optimizer import PackOptimizer
from che_bench.train.step import projected_modules, training_step


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def build(name: str, args) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_recurrent(name, get_task(args.task), members=args.members,
                           fused=not args.unfused)


def batch_tensors(args, n: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    sample = get_task(args.task).sample(n, batch, np.random.default_rng(0))
    return (torch.from_numpy(sample.inputs.copy()).expand(args.members, -1, -1),
            torch.from_numpy(sample.targets.copy()).expand(args.members, -1, -1))


def training_seconds(name: str, args) -> float:
    model = build(name, args)
    optimiser = PackOptimizer(model, [1e-3] * args.members, (0.9, 0.999), 1e-8, max_norm=1.0)
    inputs, targets = batch_tensors(args, args.train_length, args.batch)
    projected = projected_modules(model)
    return median_seconds(
        lambda: training_step(model, optimiser, inputs, targets, projected), args.steps)


def evaluation_seconds(name: str, args) -> float:
    model = build(name, args).eval()
    inputs, _ = batch_tensors(args, args.eval_length, args.eval_batch)

    def forward() -> None:
        with torch.inference_mode():
            model(inputs)

    return median_seconds(forward, args.eval_repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architectures", nargs="+", default=list(ARCHITECTURES))
    parser.add_argument("--task", default="reverse_string",
                        help="default reverse_string (output length n: T = 2n tokens)")
    parser.add_argument("--members", type=int, default=1)
    parser.add_argument("--unfused", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--train-length", type=int, default=40)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--eval-batch", type=int, default=64)
    parser.add_argument("--eval-length", type=int, default=500)
    parser.add_argument("--eval-repeats", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = get_task(args.task)
    print(f"{args.task}, {args.members} member(s), {args.threads} thread(s), "
          f"{'unfused' if args.unfused else 'fused where possible'}; median seconds")
    print(f"{'architecture':<12} {'params':>8} {'train step':>11} {'eval fwd':>10}")
    print(f"{'':<12} {'':>8} {f'B{args.batch} T{task.model_length(args.train_length)}':>11} "
          f"{f'B{args.eval_batch} T{task.model_length(args.eval_length)}':>10}")
    for name in args.architectures:
        parameters = build(name, args).describe()["parameters"]
        train = training_seconds(name, args)
        evaluation = evaluation_seconds(name, args)
        print(f"{name:<12} {parameters:>8} {train:11.3f} {evaluation:10.2f}", flush=True)


if __name__ == "__main__":
    main()
