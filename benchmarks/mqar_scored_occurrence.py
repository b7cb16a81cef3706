"""How often che-bench's MQAR scores another position than Zoology would.

With random filler (``random_non_queries``) a filler at an even offset of the query region can
repeat a key before that key's own query slot. che-bench scores the key's first occurrence
among the query slots (so that the mask is a function of the input); Zoology scores the query
slot. This draws batches from che-bench's generator, records the query slots it draws, and
counts the rows where the two rules mark different positions.

Usage: ``python benchmarks/mqar_scored_occurrence.py [--vocab-size 8192] [--pairs 16]
[--length 256] [--rows 100000] [--seed 0]`` (Zoology's Figure 2 setting (256, 16) by default; under a
minute on a laptop CPU).
"""

from __future__ import annotations

import argparse

import numpy as np

from che_bench.tasks import get_task

CHUNK_ROWS = 10_000  # rows drawn at once: the key draw sorts V/2 numbers per row


def record_query_slots(task) -> list[np.ndarray]:
    """Makes ``task`` (this instance only) append every ``[B, D]`` draw of query slots to the
    returned list."""
    drawn_slots: list[np.ndarray] = []
    draw_slots = task._query_slots

    def recording_draw(*args, **kwargs):
        drawn_slots.append(draw_slots(*args, **kwargs))
        return drawn_slots[-1]

    task._query_slots = recording_draw
    return drawn_slots


def rows_scored_differently(task, drawn_slots: list[np.ndarray], length: int, rows: int,
                            rng: np.random.Generator) -> int:
    batch = task.sample(length, rows, rng)
    zoology_mask = np.zeros_like(batch.mask)
    zoology_mask[np.arange(rows)[:, None], 2 * task.pairs(length) + 2 * drawn_slots[-1]] = True
    return int((zoology_mask != batch.mask).any(axis=1).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    task = get_task("mqar", vocab_size=args.vocab_size, num_pairs=args.pairs, random_non_queries=True)
    drawn_slots, rng = record_query_slots(task), np.random.default_rng(args.seed)
    differing = sum(rows_scored_differently(task, drawn_slots, args.length,
                                            min(CHUNK_ROWS, args.rows - start), rng)
                    for start in range(0, args.rows, CHUNK_ROWS))
    print(f"V={args.vocab_size} D={args.pairs} L={args.length}: {differing} of {args.rows} rows "
          f"({100 * differing / args.rows:.2f}%) score another position than Zoology's query slot")


if __name__ == "__main__":
    main()
