"""One part of a suite's grid, for a job among several (a SLURM array's task, a cluster of two):
``--shard K/N`` runs the K-th of N parts. The parts are whole table cells (runs that differ only
in seed, data seed and learning rate, ``RunConfig.pack_key``), dealt out in turn in the grid's
order, so that a cell's runs still train as packs and each part gets cells of every task; the
N parts cover the grid, each run once. Each job writes its own store; ``che-bench merge``
brings them together."""

from __future__ import annotations

from collections.abc import Sequence

from che_bench.config import RunConfig
from che_bench.errors import CheBenchError


def parse_shard(text: str) -> tuple[int, int]:
    """``K/N`` with 0 <= K < N, else a CheBenchError."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit()) or not 0 <= int(index) < int(count):
        raise CheBenchError(
            f"--shard takes K/N, part K of N counted from 0 (e.g. 0/4 ... 3/4); got {text!r}"
        )
    return int(index), int(count)


def shard(configs: Sequence[RunConfig], index: int, count: int) -> list[RunConfig]:
    """The runs of ``configs`` in part ``index`` of ``count``, in the grid's order."""
    cells: dict[str, int] = {}
    for config in configs:
        cells.setdefault(config.pack_key(), len(cells))
    return [config for config in configs if cells[config.pack_key()] % count == index]
