"""Side-by-side check of che-bench's recurrent baselines against CHE's own JAX code
(docs/architectures-check.md): the che-bench half, and the report over both halves.

* ``train``: trains ``che_bench.model.recurrent.build_recurrent(ARCH)`` on TASK the way CHE's
  ``experiments/training.py`` trains its models: one length per step drawn uniformly from
  1..40 by ``random.Random(0).choice`` (the very sequence CHE's ``random.seed(0)`` +
  ``UniformCurriculum`` draws), batch 128, che-bench's per-token loss (CHE's loss_fn: summed
  over classes, averaged over batch and positions), che-bench's clipped Adam
  (``PackOptimizer``: global norm 1, lr 1e-3, CHE's optax defaults). Every step's length,
  loss, accuracy and wall time (from the previous step's end: batch making included) go to
  a JSON file. The CHE half writes the same records from CHE's ``TrainingWorker``.
  ``--curriculum`` (with ``--curriculum-option KEY=VALUE``) draws the lengths by another of
  CHE's curricula instead: che-bench's ``che_bench.curricula``, on the numpy stream that
  CHE's ``np.random.seed(seed)`` starts (``length_schedule``); ``--arch-option KEY=VALUE``
  sets the model's options (``build_recurrent``).
* ``report``: the learning curves (means over windows of ``--window`` steps) of a CHE file
  and a che-bench file (refused unless both trained on the same lengths and curriculum) as a
  markdown table, the median step time of each (steps at a length
  seen before, after step ``--settle``: no JAX compilation inside), and a PNG of the curves.

    python benchmarks/bench_architectures_check.py train --architecture lstm \\
        --task parity_check --steps 2000 --out torch_lstm.json
    python benchmarks/bench_architectures_check.py report che_lstm.json torch_lstm.json \\
        --png docs/img/architectures-check-lstm.png
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from che_bench import curricula, protocol
from che_bench.commands.key_values import parse_key_values
from che_bench.model.recurrent import build_recurrent
from che_bench.tasks import get_task
from che_bench.train.optimizer import PackOptimizer
from che_bench.train.step import training_step

#: CHE experiments/example.py: UniformCurriculum over 1..sequence_length (40), batch 128.
LENGTHS = tuple(range(1, 41))
BATCH = 128
LEARNING_RATE = 1e-3
#: Mean training accuracy over a window that counts as having learnt the task.
SOLVED = 0.95


def length_schedule(curriculum: str, options: dict, steps: int, seed: int) -> tuple[list, dict]:
    """The lengths CHE's training loop draws in ``steps`` steps (step 0 first) under
    ``curriculum`` (CHE's name) with ``options``, and those options with che-bench's defaults
    filled in (what CHE's driver must be given). CHE's ``TrainingWorker`` seeds Python's and
    numpy's global generators with ``seed``: ``UniformCurriculum`` draws ``random.choice``
    from the first, ``RegularIncreaseCurriculum`` and ``ReverseExponentialCurriculum`` draw
    from the second (legacy ``RandomState``; as long as the task's sampler does not draw from
    it too: parity_check, like most, samples with JAX)."""
    lengths = range(LENGTHS[0], LENGTHS[-1] + 1)
    schedule = curricula.build(curriculum, options, lengths, steps)
    recorded = curricula.recorded_options(schedule)
    if curriculum == curricula.UNIFORM:
        python_random = random.Random(seed)
        return [python_random.choice(LENGTHS) for _ in range(steps)], recorded
    numpy_random = np.random.RandomState(seed)
    return [schedule.length(step, numpy_random) for step in range(steps)], recorded


def train(architecture: str, task_name: str, steps: int, seed: int,
          curriculum: str = curricula.UNIFORM, curriculum_options: dict | None = None,
          arch_options: dict | None = None) -> dict:
    """Every step's record of training ``architecture`` (with ``arch_options``) on
    ``task_name`` for ``steps`` steps on the lengths of ``curriculum``."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    task = get_task(task_name)
    model = build_recurrent(architecture, task, members=1, **(arch_options or {}))
    model.train()
    optimizer = PackOptimizer(model, [LEARNING_RATE], protocol.ADAM_BETAS, protocol.ADAM_EPS,
                              protocol.GRAD_CLIP_NORM)
    lengths, options = length_schedule(curriculum, curriculum_options or {}, steps, seed)
    data = np.random.default_rng(seed)
    records, last = [], time.perf_counter()
    for step, length in enumerate(lengths):
        batch = task.sample(length, BATCH, data)
        # [1, B, .] copies, as che-bench's BatchStream stacks its members' batches.
        inputs, targets, mask = (torch.from_numpy(np.stack([array]))
                                 for array in (batch.inputs, batch.targets, batch.mask))
        losses, logits = training_step(model, optimizer, inputs, targets, projected=[])
        accuracy = float((logits.argmax(-1) == targets)[mask].float().mean())
        loss = float(losses[0])
        now = time.perf_counter()
        records.append({"step": step, "length": length, "loss": loss, "accuracy": accuracy,
                        "seconds": now - last})
        last = now
    return {"side": "che-bench", "task": task_name, "architecture": architecture,
            "torch": torch.__version__, "records": records,
            "parameters": model.describe()["parameters"],
            "curriculum": {"name": curriculum, "options": options},
            "arch_options": arch_options or {}}


def window_means(records: list[dict], window: int) -> list[tuple[int, float, float]]:
    """(last step, mean loss, mean accuracy) of each run of ``window`` consecutive steps."""
    rows = []
    for end in range(window, len(records) + 1, window):
        part = records[end - window:end]
        rows.append((end, statistics.fmean(r["loss"] for r in part),
                     statistics.fmean(r["accuracy"] for r in part)))
    return rows


def median_step_ms(records: list[dict], settle: int) -> float:
    """Median wall time of the steps after ``settle`` whose length occurred before (so no
    JAX compilation is inside them), in milliseconds."""
    seen, kept = set(), []
    for record in records:
        if record["step"] >= settle and record["length"] in seen:
            kept.append(record["seconds"])
        seen.add(record["length"])
    return 1000 * statistics.median(kept)


def solved_at(rows: list[tuple[int, float, float]], window: int) -> str:
    """The first window whose mean accuracy reaches ``SOLVED``, as "first-last", or "none"."""
    for end, _, accuracy in rows:
        if accuracy >= SOLVED:
            return f"{end - window + 1}-{end}"
    return "none"


def report(che_path: str, bench_path: str, window: int, settle: int, png: str | None) -> str:
    """The markdown table and step times of both files; the PNG when ``png`` is given."""
    che, bench = (json.loads(Path(path).read_text()) for path in (che_path, bench_path))
    if [r["length"] for r in che["records"]] != [r["length"] for r in bench["records"]]:
        raise SystemExit("the two runs did not train on the same sequence of lengths")
    uniform = {"name": curricula.UNIFORM, "options": {}}  # files written before curricula
    che_curriculum, bench_curriculum = (side.get("curriculum", uniform) for side in (che, bench))
    if che_curriculum != bench_curriculum:
        raise SystemExit(f"the two runs trained on different curricula: {che_curriculum} "
                         f"and {bench_curriculum}")
    che_rows = window_means(che["records"], window)
    bench_rows = window_means(bench["records"], window)
    lines = ["| steps | CHE loss | che-bench loss | CHE accuracy | che-bench accuracy |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for (end, che_loss, che_acc), (_, loss, acc) in zip(che_rows, bench_rows):
        lines.append(f"| {end - window + 1}-{end} | {che_loss:.4f} | {loss:.4f} "
                     f"| {che_acc:.3f} | {acc:.3f} |")
    lines.append("")
    lines.append(f"Median step time (ms): CHE {median_step_ms(che['records'], settle):.1f}, "
                 f"che-bench {median_step_ms(bench['records'], settle):.1f}; total wall "
                 f"(s): CHE {sum(r['seconds'] for r in che['records']):.0f}, che-bench "
                 f"{sum(r['seconds'] for r in bench['records']):.0f}")
    lines.append(f"Load average (1 min) before/after: CHE {che['loadavg_before'][0]:.1f}/"
                 f"{che['loadavg_after'][0]:.1f}, che-bench {bench['loadavg_before'][0]:.1f}/"
                 f"{bench['loadavg_after'][0]:.1f}")
    lines.append(f"First window with mean accuracy >= {SOLVED}: CHE steps "
                 f"{solved_at(che_rows, window)}, che-bench steps {solved_at(bench_rows, window)}")
    if png:
        plot(che_rows, bench_rows, f"{che['architecture']} on {che['task']}", png)
    return "\n".join(lines)


def plot(che_rows: list, bench_rows: list, title: str, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(9, 3.2))
    for rows, label in ((che_rows, "CHE (JAX/Haiku)"), (bench_rows, "che-bench (PyTorch)")):
        steps = [row[0] for row in rows]
        loss_axis.plot(steps, [row[1] for row in rows], label=label)
        accuracy_axis.plot(steps, [row[2] for row in rows], label=label)
    loss_axis.set(xlabel="step", ylabel="training loss (window mean)", title=title)
    accuracy_axis.set(xlabel="step", ylabel="training accuracy (window mean)")
    accuracy_axis.legend()
    figure.tight_layout()
    figure.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    trainer = commands.add_parser("train")
    trainer.add_argument("--architecture", required=True)
    trainer.add_argument("--task", required=True)
    trainer.add_argument("--steps", type=int, default=2000)
    trainer.add_argument("--seed", type=int, default=0)
    trainer.add_argument("--out", required=True)
    trainer.add_argument("--curriculum", default=curricula.UNIFORM, choices=curricula.CURRICULA)
    trainer.add_argument("--curriculum-option", action="append", default=[],
                         metavar="KEY=VALUE")
    trainer.add_argument("--arch-option", action="append", default=[], metavar="KEY=VALUE")
    reporter = commands.add_parser("report")
    reporter.add_argument("che")
    reporter.add_argument("bench")
    reporter.add_argument("--window", type=int, default=50)
    reporter.add_argument("--settle", type=int, default=200)
    reporter.add_argument("--png")
    args = parser.parse_args()
    if args.command == "train":
        load = os.getloadavg()
        result = train(args.architecture, args.task, args.steps, args.seed, args.curriculum,
                       parse_key_values(args.curriculum_option, "--curriculum-option"),
                       parse_key_values(args.arch_option, "--arch-option"))
        result["loadavg_before"], result["loadavg_after"] = load, os.getloadavg()
        Path(args.out).write_text(json.dumps(result))
    else:
        print(report(args.che, args.bench, args.window, args.settle, args.png))


if __name__ == "__main__":
    main()
