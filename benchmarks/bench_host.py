"""Host work per training step of a wide pack: what the CPU spends besides the device's compute.

Two measured parts, for a pack of ``--members`` paper-preset runs (batch 128 each):

* ``batches``: making one step's training batch for every member (``BatchStream``, on the
  host whatever the device), per task, at lengths drawn by the paper's schedule (1..40): ms
  per batch (wall, and CPU time of the step loop's process), made in that process
  (``--batch-workers 0``) or in worker processes.
* ``dispatch``: one training step of the GPU step's shape (one pass, no micro-batches) plus
  the accuracy counts of the step loop, with a tiny model (width 8, one head, batch 2) so that
  compute is negligible and what remains is Python and operator dispatch (DAPE by grouped
  convolutions, as on a GPU): ms per step and
  the number of aten operators dispatched per step (counted with a dispatch mode), and how
  many are not views (those launch kernels on a GPU).

Nothing is asserted; every figure is measured on this machine.

    python benchmarks/bench_host.py --members 32 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from che_bench.checks.speed import median_seconds
from che_bench.config import make_config
from che_bench.run.runner import build_pack_model
from che_bench.train.batches import BatchStream
from che_bench.train.metrics import masked_counts
from che_bench.train.optimizer import PackOptimizer
from che_bench.train.step import projected_modules, training_step

SLOW_TASKS = ["solve_equation", "modular_arithmetic_brackets", "stack_manipulation", "reverse_string"]
TINY = dict(layers=5, dim=8, heads=1, ffn=8, batch_size=2)


class OperatorCounter(TorchDispatchMode):
    """Counts the aten operators dispatched while active, and those among them that are
    views (metadata only: no kernel on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.views += bool(getattr(func, "is_view", False))
        return func(*args, **(kwargs or {}))


def pack_configs(task: str, pe: str, kernel: int | None, members: int, **overrides):
    return [make_config(task, pe, kernel, "paper", seed=seed, length_seed=0, **overrides)
            for seed in range(members)]


def batch_ms(task: str, members: int, batches: int, workers: int) -> tuple[float, float]:
    """Mean ms per pack batch as the step loop sees it: wall time, and CPU time of the step
    loop's own process (the part workers take off it); the first batches (worker start-up)
    are not counted."""
    configs = pack_configs(task, "none", None, members)
    made = iter(BatchStream(configs[0].build_task(), configs, workers=workers))
    try:
        for _ in range(3):
            next(made)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(batches):
            next(made)
        return (1e3 * (time.perf_counter() - wall) / batches,
                1e3 * (time.process_time() - cpu) / batches)
    finally:
        made.close()


def dispatch_step(pe: str, kernel: int | None, members: int,
                  steps: int) -> tuple[float, OperatorCounter]:
    """Median ms of one tiny-model step (GPU shape, on the CPU) and its operator counts."""
    configs = pack_configs("reverse_string", pe, kernel, members, **TINY)
    task = configs[0].build_task()
    model = build_pack_model(task, configs).train()
    for module in model.modules():  # DAPE as on a GPU: grouped convolutions
        if hasattr(module, "implementation"):
            module.implementation = "convolution"
    optimizer = PackOptimizer(model, [c.lr for c in configs], configs[0].adam_betas,
                              configs[0].adam_eps, configs[0].grad_clip_norm)
    projected = projected_modules(model)
    batch = next(iter(BatchStream(task, configs)))

    def step() -> None:
        losses, logits = training_step(model, optimizer, batch.inputs, batch.targets, projected, 1)
        with torch.no_grad():
            masked_counts(logits, batch.targets, batch.mask)

    step()  # warm-up
    counter = OperatorCounter()
    with counter:
        step()
    return 1e3 * median_seconds(step, steps), counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=32)
    parser.add_argument("--tasks", nargs="+", default=SLOW_TASKS)
    parser.add_argument("--batches", type=int, default=20, help="batches timed per task")
    parser.add_argument("--batch-workers", type=int, nargs="+", default=[0],
                        help="worker processes making the batches (0: in the step loop's process)")
    parser.add_argument("--encodings", nargs="+", default=["none:", "kerple:", "kerple:3"],
                        help="pe:kernel pairs for the dispatch part (empty kernel: no DAPE)")
    parser.add_argument("--steps", type=int, default=10, help="steps timed per encoding")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parts", nargs="+", default=["batches", "dispatch"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"pack of {args.members} paper-preset runs, {args.threads} torch thread(s), measured")
    if "batches" in args.parts:
        for task in args.tasks:
            for workers in args.batch_workers:
                wall, cpu = batch_ms(task, args.members, args.batches, workers)
                print(f"batches  {task:28s} workers {workers}: {wall:7.2f} ms per pack batch "
                      f"(wall), {cpu:7.2f} ms CPU in the step loop's process")
    if "dispatch" in args.parts:
        for spec in args.encodings:
            pe, _, kernel = spec.partition(":")
            ms, counter = dispatch_step(pe, int(kernel) if kernel else None, args.members,
                                        args.steps)
            print(f"dispatch {spec:28s}: {ms:7.2f} ms per step (tiny model), "
                  f"{counter.count} operators per step, {counter.count - counter.views} "
                  "of them not views")


if __name__ == "__main__":
    main()
