"""Cost of the encoder with each positional encoding, plain and with DAPE / DAPE V2, and of
every architecture (the transformer beside CHE's recurrent baselines and plugins' models).

Three parts (run them separately on a busy machine):

* ``train``: one training step (forward + backward + Adam step) at batch 128 and length n = 40,
  the reference training regime; prints wall and CPU time per step and the k1/plain and
  k3/plain ratios.
* ``eval``: one evaluation forward (no gradients, eval mode, chunked by the memory budget) at
  batch 64 for n in --lengths; prints the time, the k/plain ratio of CPU times and the peak
  resident memory added by the forward (each configuration runs in a fresh process so the
  peaks do not mix).
* ``architectures``: per architecture (``--architectures``; default every registered one, the
  transformer with ``--pe``), the median training step at n = 40 (forward + backward + the
  optimizer of the preset the architecture's published protocol trains with: CHE's ``paper``,
  Adam at batch 128, for the transformer and CHE's baselines; ``state_tracking``, AdamW at
  batch 256, for the state-tracking models; ``--batch`` sets one batch for every row) and the
  median evaluation forward at batch 64 for each n in ``--eval-lengths`` (default 256 and
  500), on ``--task`` (default reverse_string: n + n model steps), one thread by default.
  ``--peak-memory`` evaluates each (architecture, n) in a fresh process and adds the peak
  resident memory its forwards added (a few seconds per process to start). A one-member
  lstm evaluates with torch's fused kernel unless ``--unfused``; ``--members M`` times packs
  of M.

``train`` and ``eval`` print, beside each DAPE row, the FLOPs of DAPE's filter f as che-bench
computes it (``cpu_peak``; the bias channels once per batch), its rate over the CPU time the
row adds to the plain row, and that rate's fraction of the core's measured fp32 peak (chains
of FMAs, else a 1024^3 matrix product); their first line gives the measured peaks and the
nominal one derived from /proc/cpuinfo, the next the instruction set the native kernels and
torch's own kernels run at. ``--isa avx2`` runs both at AVX2 on a CPU that has AVX-512 (the
kernels built for ``-march=x86-64-v3``, torch at ``ATEN_CPU_CAPABILITY=avx2``, MKL and oneDNN
capped at AVX2: the benchmark starts itself again with that environment,
``cpu_peak.ISA_ENVIRONMENTS``), to measure what a CPU without AVX-512 runs.

Use at most as many threads as there are idle cores: on a 2-core machine whose other core is
busy, ``--threads 2`` makes every small parallel op wait for a descheduled thread, which
inflated one evaluation forward (DAPE k = 1, T = 1500) from 45 s to 415 s.

Examples::

    python benchmarks/bench_model.py train --encodings none alibi kerple fire rope
    python benchmarks/bench_model.py eval --encodings kerple --lengths 500 \\
        --tasks duplicate_string
    python benchmarks/bench_model.py train --encodings kerple --kernels none 3 --isa avx2
    python benchmarks/bench_model.py architectures
    python benchmarks/bench_model.py architectures --architectures lstm --members 4 --unfused
    python benchmarks/bench_model.py architectures --task parity_check --peak-memory \\
        --architectures mamba deltanet gated_deltanet deltaproduct mlstm slstm
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch
from cpu_peak import (
    ISA_ENVIRONMENTS,
    dape_filter_flops,
    fma_loop_peak,
    instruction_sets,
    measured_peak,
    nominal_peak,
    run_at_isa,
)

from che_bench.allocator import keep_freed_memory, large_blocks_returned
from che_bench.checks.speed import median_seconds
from che_bench.config import RunConfig, make_config
from che_bench.model.architectures import (
    ARCHITECTURES,
    TRANSFORMER,
    build_architecture,
    get_architecture,
)
from che_bench.model.base import BenchModel
from che_bench.model.encoder import MODEL_DEFAULTS, build_model
from che_bench.model.state_tracking import StateTrackingModel
from che_bench.protocol import preset_settings
from che_bench.tasks import get_task
from che_bench.train.optimizer import PackOptimizer, pack_optimizer
from che_bench.train.step import projected_modules, training_step

# glibc's allocator as the che-bench command sets it (che_bench.allocator), here and in the
# fresh processes that import this module.
keep_freed_memory()

T = TypeVar("T")


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
    """Architecture ``name`` for ``args.task`` (``args.members`` members, seed 0); ``fused``
    only where the architecture takes it (``not args.unfused``), ``args.pe`` only for the
    transformer."""
    torch.manual_seed(0)
    entry = get_architecture(name)
    options = {"fused": not args.unfused} if "fused" in entry.defaults else {}
    pe = args.pe if entry.name == TRANSFORMER else "none"
    return build_architecture(name, get_task(args.task), pe=pe, members=args.members, **options)


def protocol_preset(name: str) -> str:
    """The preset of ``name``'s published protocol: ``state_tracking`` (the xLSTM harness) for
    the state-tracking models, CHE's ``paper`` for the others."""
    build = get_architecture(name).build
    state_tracking = isinstance(build, type) and issubclass(build, StateTrackingModel)
    return "state_tracking" if state_tracking else "paper"


def protocol_config(name: str, args) -> RunConfig:
    """The run settings ``name`` trains with under its protocol (``args.batch`` over its batch)."""
    pe = args.pe if get_architecture(name).name == TRANSFORMER else None
    return make_config(args.task, pe, preset=protocol_preset(name), arch=name,
                       batch_size=args.batch)


def member_batch(args, n: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of ``args.task`` at length n, the same for every member: ``[M, B, .]``."""
    sample = get_task(args.task).sample(n, batch, np.random.default_rng(0))
    return (torch.from_numpy(sample.inputs.copy()).expand(args.members, -1, -1),
            torch.from_numpy(sample.targets.copy()).expand(args.members, -1, -1))


def training_step_of(model: BenchModel, config: RunConfig, args) -> Callable[[], None]:
    """One training step of ``model`` (``che-bench run``'s: forward, backward, ``config``'s
    optimizer) on a fixed batch of ``config.batch_size`` sequences at ``args.train_length``."""
    optimiser = pack_optimizer(model, [config] * args.members)
    inputs, targets = member_batch(args, args.train_length, config.batch_size)
    projected = projected_modules(model)

    def step() -> None:
        training_step(model, optimiser, inputs, targets, projected)

    return step


def _status_bytes(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its high-water mark) of /proc/self/status.
    Not ``getrusage``'s ``ru_maxrss``: Linux carries the parent's peak over into a process
    it spawns (fork + exec), so a child of a large parent would report the parent's."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise OSError(f"no {field} in /proc/self/status")


def measure_evaluation(make_model: Callable[[], BenchModel], inputs: torch.Tensor, threads: int,
                       warm_ups: int, repeats: int) -> tuple[float, float, int]:
    """(median wall s, median CPU s, peak bytes above the resident set before the first
    forward) of ``repeats`` evaluation forwards (no gradients, eval mode) of ``make_model()``
    (built after ``torch.manual_seed(0)``) on ``inputs``, after ``warm_ups`` untimed ones. The
    peak is the process's: meaningful in a fresh process (``in_fresh_process``)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = make_model().eval()
    before = _status_bytes("VmRSS")
    walls, cpus = [], []
    with torch.inference_mode(), large_blocks_returned():  # as the runs' evaluations
        for index in range(warm_ups + repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            model(inputs)
            if index >= warm_ups:
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus), _status_bytes("VmHWM") - before


def in_fresh_process(function: Callable[..., T], *arguments) -> T:
    """``function(*arguments)`` in a fresh (spawned) process, so that its peak memory is its own."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, arguments)


def transformer_for(task_name: str, pe: str, kernel: int | None, budget: int) -> BenchModel:
    return build_model(get_task(task_name), pe, kernel, memory_budget_bytes=budget)


def time_evaluation(task_name, pe, kernel, n, args) -> tuple[float, float, int]:
    """(wall s, CPU s, peak bytes above the pre-forward RSS) of one evaluation forward."""
    inputs = torch.from_numpy(
        get_task(task_name).sample(n, args.eval_batch, np.random.default_rng(0)).inputs.copy())
    make = functools.partial(transformer_for, task_name, pe, kernel, args.memory_budget)
    return in_fresh_process(measure_evaluation, make, inputs, args.threads, 0, 1)


def print_peaks() -> float:
    """Print the core's fp32 peaks (``cpu_peak``) and return the one the fractions are of
    (the FMA loop's, else the matrix product's), GFLOP/s."""
    nominal, derivation = nominal_peak()
    product, loop = measured_peak(), fma_loop_peak()
    print(f"fp32 peak of one core: nominal {nominal:.0f} GFLOP/s = {derivation}; measured "
          f"{product:.0f} GFLOP/s (1024^3 matrix product, {torch.get_num_threads()} thread(s))"
          + ("" if loop is None else f", {loop:.0f} GFLOP/s (FMA loop, cpu_peak.fma_loop_peak)")
          + ". DAPE's filter: GFLOP of f as computed (cpu_peak.dape_filter_flops), GFLOP/s over "
          "the CPU time added to the plain row, % of the "
          + ("matrix product's rate" if loop is None else "FMA loop's rate"))
    print(instruction_sets())
    return product if loop is None else loop


def filter_rate(task_name: str, pe: str, kernel: int | None, batch: int, length: int,
                extra_seconds: float | None, peak: float, training: bool) -> str:
    """The filter's columns of a row: GFLOP, GFLOP/s over ``extra_seconds``, % of ``peak``."""
    flops = dape_filter_flops(build_model(get_task(task_name), pe, kernel), batch, length,
                              training) / 1e9
    if not flops or not extra_seconds or extra_seconds <= 0:
        return f"{flops:8.4g} {'-':>7} {'-':>6}"
    rate = flops / extra_seconds
    return f"{flops:8.4g} {rate:7.1f} {100 * rate / peak:6.1f}"


def run_train(args) -> None:
    peak = print_peaks()
    print(f"training step: batch {args.batch}, n = {args.train_length}, {args.steps} timed steps, "
          f"{torch.get_num_threads()} thread(s); median per step")
    print(f"{'task':<20} {'encoding':<16} {'kernel':<6} {'wall ms':>9} {'cpu ms':>9} "
          f"{'cpu/plain':>9} {'f GFLOP':>8} {'GFLOP/s':>7} {'%peak':>6}")
    for task_name in args.tasks:
        length = get_task(task_name).model_length(args.train_length)
        for pe in args.encodings:
            plain_cpu = None
            for kernel in args.kernels:
                wall, cpu = time_training_step(task_name, pe, kernel, args)
                if kernel is None:
                    plain_cpu = cpu
                ratio = f"{cpu / plain_cpu:9.2f}" if plain_cpu else f"{'-':>9}"
                extra = cpu - plain_cpu if plain_cpu else None
                rate = filter_rate(task_name, pe, kernel, args.batch, length, extra, peak, True)
                print(f"{task_name:<20} {pe:<16} {kernel_label(kernel):<6} {wall * 1e3:9.1f} "
                      f"{cpu * 1e3:9.1f} {ratio} {rate}", flush=True)


def run_eval(args) -> None:
    fp32_peak = print_peaks()
    print(f"evaluation forward: batch {args.eval_batch}, memory budget "
          f"{args.memory_budget / 2**30:.2f} GiB, {args.threads} thread(s)")
    print(f"{'task':<26} {'n':>4} {'T':>5} {'encoding':<14} {'kernel':<6} {'wall s':>8} "
          f"{'cpu s':>8} {'cpu/plain':>9} {'peak MiB':>9} {'f GFLOP':>8} {'GFLOP/s':>7} "
          f"{'%peak':>6}")
    for task_name in args.tasks:
        task = get_task(task_name)
        for n in args.lengths:
            tokens = task.model_length(n)
            for pe in args.encodings:
                plain_cpu = None
                for kernel in args.kernels:
                    wall, cpu, peak = time_evaluation(task_name, pe, kernel, n, args)
                    if kernel is None:
                        plain_cpu = cpu
                    ratio = f"{cpu / plain_cpu:9.2f}" if plain_cpu else f"{'-':>9}"
                    extra = cpu - plain_cpu if plain_cpu else None
                    rate = filter_rate(task_name, pe, kernel, args.eval_batch, tokens, extra,
                                       fp32_peak, False)
                    print(f"{task_name:<26} {n:>4} {tokens:>5} {pe:<14} {kernel_label(kernel):<6} "
                          f"{wall:8.2f} {cpu:8.2f} {ratio} {peak / 2**20:9.0f} {rate}", flush=True)


def architecture_row(name: str, args) -> str:
    """One row of the architectures part: parameters, batch, training step, evaluations."""
    model = build_for_timing(name, args)
    parameters = sum(p.numel() for p in model.parameters()) // args.members
    config = protocol_config(name, args)
    step = training_step_of(model, config, args)
    step()  # warm-up
    cells = [f"{name:<15} {parameters:>8} {config.batch_size:>5} "
             f"{median_seconds(step, args.steps):11.3f}"]
    for n in args.eval_lengths:
        inputs, _ = member_batch(args, n, args.eval_batch)
        if args.peak_memory:
            make = functools.partial(build_for_timing, name, args)
            wall, _, peak = in_fresh_process(
                measure_evaluation, make, inputs, args.threads, 1, args.eval_repeats)
            cells.append(f"{wall:10.2f} {peak / 2**20:8.0f}")
        else:
            wall = measure_evaluation(lambda: model, inputs, args.threads, 1, args.eval_repeats)[0]
            cells.append(f"{wall:10.2f}")
    return " ".join(cells)


def run_architectures(args) -> None:
    task = get_task(args.task)
    print(f"{args.task}, {args.members} member(s), {torch.get_num_threads()} thread(s), "
          f"transformer: {args.pe}, {'unfused' if args.unfused else 'fused where possible'}; "
          "median seconds" + (", peak MiB of the evaluation" if args.peak_memory else ""))
    eval_columns = ""
    eval_shapes = ""
    for n in args.eval_lengths:
        width = 19 if args.peak_memory else 10
        eval_columns += f" {'eval fwd' + (' / MiB' if args.peak_memory else ''):>{width}}"
        eval_shapes += f" {f'B{args.eval_batch} T{task.model_length(n)}':>{width}}"
    print(f"{'architecture':<15} {'params':>8} {'batch':>5} {'train step':>11}{eval_columns}")
    print(f"{'':<15} {'':>8} {'':>5} {f'T{task.model_length(args.train_length)}':>11}"
          f"{eval_shapes}")
    for name in args.architectures or list(ARCHITECTURES.names()):
        print(architecture_row(name, args), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("train", "eval", "architectures"))
    parser.add_argument("--encodings", nargs="+",
                        default=["none", "alibi", "kerple", "fire", "rope"])
    parser.add_argument("--kernels", nargs="+", type=parse_kernel, default=[None, 1, 3],
                        help="none (plain), 1, 3, ... (default: none 1 3)")
    parser.add_argument("--tasks", nargs="+", default=None,
                        help="train default: parity_check (T = 41); eval default: "
                             "duplicate_string missing_duplicate_string")
    parser.add_argument("--threads", type=int, default=None,
                        help="default: 1 for architectures, torch's default otherwise")
    parser.add_argument("--batch", type=int, default=None,
                        help="train default: the paper preset's (128); architectures default: "
                             "each architecture's protocol's (128 CHE, 256 state tracking)")
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
    architectures.add_argument("--eval-lengths", "--eval-length", nargs="+", type=int,
                               default=[256, 500], dest="eval_lengths")
    architectures.add_argument("--peak-memory", action="store_true",
                               help="evaluate in a fresh process per length; print its peak")
    architectures.add_argument("--eval-repeats", type=int, default=1)
    parser.add_argument("--isa", choices=tuple(ISA_ENVIRONMENTS), default="native",
                        help="instruction set of the native kernels, torch, MKL and oneDNN: "
                             "native (this CPU's) or avx2 (x86-64-v3 kernels, the libraries "
                             "capped at AVX2)")
    args = parser.parse_args()
    run_at_isa(parser.error, args.isa)
    if args.threads is None:
        args.threads = 1 if args.part == "architectures" else torch.get_num_threads()
    torch.set_num_threads(args.threads)
    if args.part == "architectures":
        run_architectures(args)
    elif args.part == "train":
        args.tasks = args.tasks or ["parity_check"]
        args.batch = args.batch or preset_settings("paper")["batch_size"]
        run_train(args)
    else:
        args.tasks = args.tasks or ["duplicate_string", "missing_duplicate_string"]
        run_eval(args)


if __name__ == "__main__":
    main()
