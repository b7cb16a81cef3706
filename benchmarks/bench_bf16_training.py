"""bf16 training on this CPU: one training step of ``--preset state_tracking_harness``'s
DeltaNet (modular arithmetic, batch 256 of mixed lengths 2..38, one thread) in float32, in
bf16 with torch's own bf16 matrix products and in bf16 with che-bench's (``bf16_product`` of
``che_bench.members``: bf16 operands and results, float32's product in between), and a
9,984 x 128 by 128 x 512 product each way. On a CPU whose torch has no native bf16 product
(oneDNN takes bf16 on x86 CPUs with AVX-512), torch's own runs a scalar reference kernel;
che-bench's takes over there, and this measures by how much it gains.

    python benchmarks/bench_bf16_training.py [--repeats 3] [--batch 256]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from che_bench import members
from che_bench.checks.speed import median_seconds, step_seconds
from che_bench.config import make_config
from che_bench.cpu import cpu_description


def _median_seconds(work: Callable[[], object], repeats: int) -> float:
    work()  # warm-up
    return median_seconds(work, repeats)


def _product_seconds(repeats: int) -> dict[str, float]:
    a, b = torch.randn(1, 9984, 128), torch.randn(1, 128, 512)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    return {
        "float32": _median_seconds(lambda: torch.bmm(a, b), 5 * repeats),
        "bf16, torch's": _median_seconds(lambda: torch.bmm(a16, b16), 5 * repeats),
        "bf16, che-bench's": _median_seconds(lambda: members.bf16_product(a, b), 5 * repeats),
    }


def _step_seconds(repeats: int, batch: int) -> dict[str, float]:
    timings = {}
    lengths = [2 + (i % 37) for i in range(batch)]
    for name, precision, native in (
        ("float32", "float32", True),
        ("bf16, torch's", "bfloat16", True),
        ("bf16, che-bench's", "bfloat16", False),
    ):
        members.native_bf16_products = lambda native=native: native  # type: ignore[method-assign]
        config = make_config(
            "modular_arithmetic",
            arch="deltanet",
            preset="state_tracking_harness",
            arch_options={"negative_eigenvalues": True},
            train_precision=precision,
            batch_size=batch,
        )
        timings[name] = step_seconds(
            [config], torch.device("cpu"), repeats=repeats, mixed_lengths=lengths
        )
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    native = members.native_bf16_products()
    print(f"CPU: {cpu_description()}; torch {torch.__version__}, one thread")
    print(f"torch's native bf16 products (oneDNN): {'yes' if native else 'no'}")
    products = _product_seconds(args.repeats)
    steps = _step_seconds(args.repeats, args.batch)
    print(f"{'':20}{'product (ms)':>14}{'step (s)':>10}{'step / float32':>16}")
    for name, seconds in steps.items():
        ratio = seconds / steps["float32"]
        print(f"{name:20}{products[name] * 1e3:>14.1f}{seconds:>10.2f}{ratio:>15.2f}x")


if __name__ == "__main__":
    main()
