"""Time ``task.sample(n, 512)`` for every task at n = 40 and n = 500 (median of repeats),
plus the oracle ``task.solve`` on the n = 500 batch.

Usage: ``.venv/bin/python benchmarks/bench_tasks.py [--repeats 5] [--batch-size 512]``
"""

from __future__ import annotations

import argparse

import numpy as np

from che_bench.checks.speed import median_seconds
from che_bench.tasks import get_task, list_tasks

LENGTHS = (40, 500)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=512)
    args = parser.parse_args()

    header = ["task"] + [f"sample n={n} (ms)" for n in LENGTHS] + [f"solve n={LENGTHS[-1]} (ms)"]
    print(f"batch size {args.batch_size}, median of {args.repeats} repeats")
    print(f"{header[0]:<28}" + "".join(f"{column:>20}" for column in header[1:]))
    for name in list_tasks():
        task = get_task(name)
        rng = np.random.default_rng(0)
        row = [
            median_seconds(lambda n=n: task.sample(n, args.batch_size, rng), args.repeats)
            for n in LENGTHS
        ]
        inputs = task.sample(LENGTHS[-1], args.batch_size, rng).inputs
        row.append(median_seconds(lambda: task.solve(inputs), args.repeats))
        print(f"{name:<28}" + "".join(f"{1000 * seconds:>20.1f}" for seconds in row))


if __name__ == "__main__":
    main()
