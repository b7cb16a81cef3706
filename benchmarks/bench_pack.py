"""Packed training: what a pack of N runs costs against N single runs, on this device.

Parts (``--parts``, default all that fit the device):

* ``step``: one training step (forward, backward, clipped Adam, projection: the step of
  ``che-bench run``, with its micro-batches on a CPU) of a pack of N paper-size models (5 layers, width 64, batch 128 each) at
  the longest training length n = 40, for each task x encoding x kernel and each N in
  ``--packs``. Prints ms per step, runs per device-hour at the paper's 200k steps, and the
  ratio (pack-of-N step) / (N x single step): below 1, packing gains.
* ``end_to_end``: one paper-preset run (200k steps + every length 41..500 x 512 sequences),
  EXTRAPOLATED from ``--train-steps`` real training steps over the length schedule (timed
  after ``--warmup-steps`` untimed ones: CUDA start-up, kernel choice, allocator, batch
  workers, none of it extrapolated) and the
  evaluation, under the run's own memory budget, of a few lengths (a + b*T + c*T^2 fitted
  and summed over 41..500), for a single run and for a pack of ``--end-to-end-pack`` runs;
  ``--measure`` runs the single paper run for real instead (hours on a CPU).
* ``eval_memory``: one evaluation sub-batch (64 sequences) of a pack at n = 500 with the
  memory budget of a run's evaluation (default 1 GiB; on a GPU sized from its free memory):
  time and peak memory.

Every figure is printed labelled "measured" or "extrapolated" and, with ``--json FILE``,
written with the device and software versions. Nothing is asserted.

    python benchmarks/bench_pack.py --packs 1 2 4 --threads 1             # this CPU
    python benchmarks/bench_pack.py --device cuda --json results.json      # a GPU: all parts
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import numpy as np
import torch

from che_bench.checks.speed import peak_memory_bytes, step_seconds, synchronize
from che_bench.config import make_config
from che_bench.eval.evaluation import length_accuracies, use_evaluation_budget
from che_bench.run.device import configure_numerics, describe_device, resolve_device
from che_bench.run.provenance import software_versions
from che_bench.run.runner import build_pack_model, execute_run
from che_bench.train.loop import sync_every_for, train_pack

PAPER_STEPS = 200_000


def paper_cell(task: str, pe: str, kernel: int | None, members: int, **overrides):
    """Configs of ``members`` paper-preset runs of one table cell (seeds 0.., lr 1e-4)."""
    return [make_config(task, pe, kernel, "paper", seed=seed, length_seed=0, **overrides)
            for seed in range(members)]


def pack_step_seconds(task: str, pe: str, kernel: int | None, members: int,
                      device: torch.device, repeats: int) -> tuple[float, int]:
    """Median seconds of one training step of a pack at n = 40 (after two warm-up steps: the
    allocator, the kernels), and the peak memory."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = step_seconds(paper_cell(task, pe, kernel, members), device, repeats, warm_up=2)
    return seconds, peak_memory_bytes(device)


def run_steps(args, device, report) -> None:
    print(f"training step at n = 40, batch 128 per run, paper-size model, {args.repeats} timed "
          f"steps (median), {describe_device(device)}: measured")
    print(f"{'task':<26} {'encoding':<8} {'kernel':<6} {'N':>3} {'ms/step':>9} {'runs/h':>8} "
          f"{'N-pack/(N x single)':>20} {'peak MiB':>9}")
    for task in args.tasks:
        for pe, kernel in args.configs:
            single = None
            for members in args.packs:
                seconds, peak = pack_step_seconds(task, pe, kernel, members, device, args.repeats)
                single = seconds if members == 1 else single
                ratio = seconds / (members * single) if single else float("nan")
                runs_per_hour = members * 3600 / (seconds * PAPER_STEPS)
                print(f"{task:<26} {pe:<8} {kernel_label(kernel):<6} {members:>3} "
                      f"{seconds * 1e3:9.1f} {runs_per_hour:8.3f} {ratio:20.3f} "
                      f"{peak / 2**20:9.0f}", flush=True)
                report["step"].append({
                    "task": task, "pe": pe, "kernel": kernel, "members": members,
                    "seconds_per_step": seconds, "runs_per_hour_at_200k_steps": runs_per_hour,
                    "ratio_to_members_x_single": ratio, "peak_bytes": peak, "label": "measured",
                })


def fitted_total(tokens: list[int], seconds: list[float], all_tokens: list[int]) -> float:
    """Sum over ``all_tokens`` of a + b*T + c*T^2 fitted to the measured (T, seconds)."""
    design = np.array([[1.0, t, t * t] for t in tokens])
    coefficients = np.linalg.lstsq(design, np.array(seconds), rcond=None)[0]
    return sum(float(np.dot(coefficients, [1.0, t, t * t])) for t in all_tokens)


def run_end_to_end(args, device, report) -> None:
    task, pe, kernel = args.end_to_end_cell
    for members in sorted({1, args.end_to_end_pack}):
        configs = paper_cell(task, pe, kernel, members)
        if args.measure and members == 1:
            result = execute_run(configs[0], device=str(device), progress=False)
            timings = result.timings
            print(f"paper run {task}/{pe}/{kernel_label(kernel)}: measured train "
                  f"{timings['train_s']:.0f} s + eval {timings.get('eval_s', 0):.0f} s")
            report["end_to_end"].append({"members": 1, "train_s": timings["train_s"],
                                         "eval_s": timings.get("eval_s"), "label": "measured"})
            continue
        task_obj = configs[0].build_task()
        short = [dataclasses.replace(c, steps=args.train_steps) for c in configs]
        model, seconds_per_step = timed_training(task_obj, short, device, args.warmup_steps)
        train_seconds = seconds_per_step * PAPER_STEPS
        model.eval()
        use_evaluation_budget(model, device)
        length_accuracies(model, task_obj, configs[0], args.eval_lengths[0], device)  # warm-up
        tokens, seconds = [], []
        for n in args.eval_lengths:
            started = time.perf_counter()
            length_accuracies(model, task_obj, configs[0], n, device)
            seconds.append(time.perf_counter() - started)
            tokens.append(task_obj.model_length(n))
        all_tokens = [task_obj.model_length(n)
                      for n in configs[0].test_lengths]
        eval_seconds = fitted_total(tokens, seconds, all_tokens)
        total = train_seconds + eval_seconds
        print(f"paper preset, {task}/{pe}/{kernel_label(kernel)}, pack of {members}: "
              f"extrapolated train {train_seconds / 60:.1f} min (from {args.train_steps} measured "
              f"steps) + eval {eval_seconds / 60:.1f} min (from n = "
              f"{', '.join(map(str, args.eval_lengths))}, measured {sum(seconds):.1f} s) = "
              f"{total / 60:.1f} min for {members} run(s), {total / 60 / members:.1f} min per run")
        report["end_to_end"].append({
            "task": task, "pe": pe, "kernel": kernel, "members": members,
            "train_s": train_seconds, "eval_s": eval_seconds, "measured_train_steps":
            args.train_steps, "measured_eval_lengths": args.eval_lengths,
            "measured_eval_s": seconds, "label": "extrapolated",
        })


def timed_training(task_obj, configs, device: torch.device, warmup_steps: int):
    """The pack model of ``configs`` trained for ``warmup_steps`` more than their steps, and
    the seconds per step after the warm-up: from the first read of the device at or after it
    to the last one (the loop of ``che-bench run``, reading every ``sync_every_for`` steps).
    Start-up (CUDA, kernel choice, the allocator, batch workers) is neither timed nor
    extrapolated."""
    longer = [dataclasses.replace(c, steps=warmup_steps + c.steps) for c in configs]
    model = build_pack_model(task_obj, longer).to(device)
    reads: list[tuple[int, float]] = []
    train_pack(model, task_obj, longer, device, progress=False,
               sync_every=sync_every_for(device),
               on_step=lambda step, losses: reads.append((step, time.perf_counter())))
    (first_step, first_at), (last_step, last_at) = next(
        read for read in reads if read[0] >= warmup_steps), reads[-1]
    if last_step == first_step:
        raise SystemExit(f"no device read after the warm-up: raise --train-steps above "
                         f"{sync_every_for(device)}")
    return model, (last_at - first_at) / (last_step - first_step)


def run_eval_memory(args, device, report) -> None:
    task, pe, kernel = args.eval_memory_cell
    configs = paper_cell(task, pe, kernel, args.eval_memory_pack, eval_samples=64)
    task_obj = configs[0].build_task()
    model = build_pack_model(task_obj, configs).to(device).eval()
    use_evaluation_budget(model, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = peak_memory_bytes(device) if device.type == "cuda" else 0
    started = time.perf_counter()
    length_accuracies(model, task_obj, configs[0], 500, device)
    synchronize(device)
    seconds = time.perf_counter() - started
    peak = peak_memory_bytes(device) - before
    tokens = task_obj.model_length(500)
    print(f"evaluation of a pack of {len(configs)} ({task}/{pe}/{kernel_label(kernel)}) at n = 500 "
          f"(T = {tokens}), 64 sequences: measured {seconds:.1f} s, peak "
          f"{peak / 2**30:.2f} GiB ({'GPU allocated' if device.type == 'cuda' else 'process RSS'})")
    report["eval_memory"].append({"task": task, "pe": pe, "kernel": kernel,
                                  "members": len(configs), "tokens": tokens, "seconds": seconds,
                                  "peak_bytes": peak, "label": "measured"})


def kernel_label(kernel: int | None) -> str:
    return "plain" if kernel is None else f"k{kernel}"


def parse_cell(text: str) -> tuple[str, str, int | None]:
    task, pe, kernel = text.split(":")
    return task, pe, None if kernel in ("none", "plain") else int(kernel)


def parse_config(text: str) -> tuple[str, int | None]:
    pe, _, kernel = text.partition(":")
    return pe, None if kernel in ("", "none", "plain") else int(kernel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--parts", nargs="+", choices=("step", "end_to_end", "eval_memory"),
                        default=None, help="default: step on a CPU, every part on a GPU")
    parser.add_argument("--packs", nargs="+", type=int, default=None,
                        help="pack sizes (default 1 2 4 8 16 30 on a GPU, 1 2 4 on a CPU)")
    parser.add_argument("--tasks", nargs="+", default=["reverse_string", "missing_duplicate_string"])
    parser.add_argument("--configs", nargs="+", type=parse_config, default=["kerple", "kerple:3"],
                        help="encoding[:kernel] (default kerple and kerple:3)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--end-to-end-cell", type=parse_cell,
                        default=parse_cell("missing_duplicate_string:kerple:3"))
    parser.add_argument("--end-to-end-pack", type=int, default=30)
    parser.add_argument("--train-steps", type=int, default=500,
                        help="real training steps behind the end-to-end extrapolation")
    parser.add_argument("--warmup-steps", type=int, default=50,
                        help="untimed training steps before the timed ones")
    parser.add_argument("--eval-lengths", nargs="+", type=int, default=[41, 150, 300, 500])
    parser.add_argument("--measure", action="store_true",
                        help="end_to_end: run the single paper run for real")
    parser.add_argument("--eval-memory-cell", type=parse_cell,
                        default=parse_cell("duplicate_string:kerple:3"))
    parser.add_argument("--eval-memory-pack", type=int, default=None,
                        help="members of the n = 500 evaluation (default 30 on a GPU, 4 on a CPU)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    args.configs = [parse_config(c) if isinstance(c, str) else c for c in args.configs]
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    args.parts = args.parts or (["step", "end_to_end", "eval_memory"] if gpu else ["step"])
    args.packs = args.packs or ([1, 2, 4, 8, 16, 30] if gpu else [1, 2, 4])
    args.eval_memory_pack = args.eval_memory_pack or (30 if gpu else 4)
    configure_numerics(tf32=False)  # the default numerics of che-bench (cuDNN's too)
    report = {
        "device": describe_device(device),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "versions": {**software_versions(), "cuda": torch.version.cuda},
        "step": [], "end_to_end": [], "eval_memory": [],
    }
    for part in args.parts:
        {"step": run_steps, "end_to_end": run_end_to_end, "eval_memory": run_eval_memory}[part](
            args, device, report)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
