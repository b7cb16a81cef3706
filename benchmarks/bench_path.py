"""Cost of PaTH's scores (``che_bench.encodings.path_transform``) beside plain ``q k^T`` scores,
at the paper encoder's head shape (width 64, 8 heads of 8), one thread by default.

* ``train``: forward + backward of one layer's scores at batch 128, T = 40 tokens (all rows as
  one chunk, as in training): plain ``q k^T / sqrt(d)``; PaTH's fast form from given factors
  (causal and bidirectional); the same with the factors made from x (``PathProjections``, one
  per direction); and the plain recurrence (the tests' oracle). Median CPU and wall ms.
* ``eval``: one layer's scores without gradients at batch 64, T = 500 tokens, over row chunks of
  ``--rows``, each in a fresh process: CPU s and the peak resident memory the computation
  added (the prepared state plus one chunk's maps; the chunk's scores are dropped after use);
  ``--block`` sets PaTH's most tokens per block (64).

    python benchmarks/bench_path.py train
    python benchmarks/bench_path.py eval --rows 100 500
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_model import _status_bytes, in_fresh_process

from che_bench.encodings.base import scaled_scores
from che_bench.encodings.path_parameters import PathProjections
from che_bench.encodings.path_transform import (
    BLOCK,
    Householders,
    path_scores_recurrent,
    prepare_path,
)

HEADS, HEAD_DIM = 8, 8


def inputs(batch: int, length: int, grad: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    shape = (1, batch, HEADS, length)
    tensors = {
        "q": torch.randn(*shape, HEAD_DIM),
        "k": torch.randn(*shape, HEAD_DIM),
        "x": torch.randn(1, batch, length, HEADS * HEAD_DIM),
        "w": F.normalize(torch.randn(*shape, HEAD_DIM), dim=-1),
        "w_right": F.normalize(torch.randn(*shape, HEAD_DIM), dim=-1),
        "beta": 2 * torch.rand(shape),
        "beta_right": 2 * torch.rand(shape),
    }
    return {name: t.requires_grad_(grad) for name, t in tensors.items()}


def score_functions(batch: int, length: int) -> dict[str, Callable[[dict], torch.Tensor]]:
    """Each variant: the scores ``[1, B, H, T, T]`` of all rows from the input tensors."""
    rows = slice(0, length)
    left = PathProjections(1, HEADS * HEAD_DIM, HEADS)
    right = PathProjections(1, HEADS * HEAD_DIM, HEADS, anticausal=True)

    def factors(t, bidirectional):
        both = Householders(t["w"], t["beta"]), Householders(t["w_right"], t["beta_right"])
        return both if bidirectional else (both[0], None)

    return {
        "plain q k^T": lambda t: scaled_scores(t["q"], t["k"], rows),
        "PaTH causal": lambda t: prepare_path(t["q"], t["k"], *factors(t, False)).scores(rows),
        "PaTH bidirectional": lambda t: prepare_path(t["q"], t["k"], *factors(t, True)).scores(
            rows
        ),
        "PaTH causal, factors from x": lambda t: prepare_path(
            t["q"], t["k"], left(t["x"]).householders
        ).scores(rows),
        "PaTH bidir., factors from x": lambda t: prepare_path(
            t["q"], t["k"], left(t["x"]).householders, right(t["x"]).householders
        ).scores(rows),
        "plain recurrence, causal": lambda t: path_scores_recurrent(
            t["q"], t["k"], *factors(t, False)
        ),
    }


def cpu_and_wall(call: Callable[[], object], repeats: int) -> tuple[float, float]:
    cpus, walls = [], []
    call()  # warm-up
    for _ in range(repeats):
        cpu, wall = time.process_time(), time.perf_counter()
        call()
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
    return statistics.median(cpus), statistics.median(walls)


def run_train(args) -> None:
    print(
        f"one layer's scores, forward + backward: batch {args.batch}, T = {args.length} tokens, "
        f"{HEADS} heads of {HEAD_DIM}, {torch.get_num_threads()} thread(s), median of "
        f"{args.repeats}"
    )
    print(f"{'scores':<30} {'cpu ms':>8} {'wall ms':>8} {'cpu/plain':>9}")
    tensors = inputs(args.batch, args.length, grad=True)
    weights = torch.randn(1, args.batch, HEADS, args.length, args.length)
    plain = None
    for name, scores in score_functions(args.batch, args.length).items():

        def step(scores=scores):
            (scores(tensors) * weights).sum().backward()

        cpu, wall = cpu_and_wall(step, args.repeats)
        plain = plain or cpu
        print(f"{name:<30} {cpu * 1e3:8.1f} {wall * 1e3:8.1f} {cpu / plain:9.1f}", flush=True)


def evaluate(name: str, args) -> tuple[float, int]:
    """(CPU s, peak bytes added) of one no-grad pass of ``name`` over row chunks of ``args.rows``
    (``args.block``: PaTH's most tokens per block)."""
    torch.set_num_threads(args.threads)
    length, rows = args.eval_length, args.chunk
    t = inputs(args.eval_batch, length, grad=False)
    before = _status_bytes("VmRSS")
    cpu = time.process_time()
    with torch.inference_mode():
        if name == "plain q k^T":
            for start in range(0, length, rows):
                scaled_scores(t["q"], t["k"], slice(start, start + rows))
        else:
            left = Householders(t["w"], t["beta"])
            right = Householders(t["w_right"], t["beta_right"]) if "bidir" in name else None
            prepared = prepare_path(t["q"], t["k"], left, right, block=args.block)
            for start in range(0, length, rows):
                prepared.scores(slice(start, start + rows))
    return time.process_time() - cpu, _status_bytes("VmHWM") - before


def run_eval(args) -> None:
    print(
        f"one layer's scores without gradients: batch {args.eval_batch}, T = {args.eval_length}, "
        f"{args.threads} thread(s), PaTH blocks of at most {args.block}, each row in a fresh "
        "process"
    )
    print(f"{'scores':<22} {'rows':>5} {'cpu s':>7} {'peak MiB':>9} {'[B,H,R,T] MiB':>14}")
    for rows in args.rows:
        chunk = 4 * args.eval_batch * HEADS * rows * args.eval_length / 2**20
        for name in ("plain q k^T", "PaTH causal", "PaTH bidirectional"):
            cpu, peak = in_fresh_process(
                evaluate, name, argparse.Namespace(**vars(args), chunk=rows)
            )
            print(f"{name:<22} {rows:>5} {cpu:7.2f} {peak / 2**20:9.0f} {chunk:14.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["train", "eval"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--eval-batch", type=int, default=64)
    parser.add_argument("--eval-length", type=int, default=500)
    parser.add_argument("--rows", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--block", type=int, default=BLOCK)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    {"train": run_train, "eval": run_eval}[args.part](args)


if __name__ == "__main__":
    main()
