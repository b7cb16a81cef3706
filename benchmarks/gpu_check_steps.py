"""The steps of ``benchmarks/gpu_check.py`` that run che-bench, each called in a process of its
own as ``step(device=..., rehearse=..., timeout_s=..., record=...)``: ``record(result)``
keeps what the step has measured so far (a step stopped at its timeout keeps it), and the
step returns its whole result, a JSON-able dict (``passed``: its own verdict, where it has
one). ``rehearse``: tiny sizes and few steps, to run on a CPU in seconds (no figure of it
means anything); otherwise the sizes of ``FULL``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_model import protocol_preset
from bench_pack import timed_training

from che_bench.checks.architecture_check import built_in_architectures, small_options
from che_bench.checks.selftest import CHECKS, SPEED, run_selftest
from che_bench.checks.speed import synchronize
from che_bench.checks.training_checks import deterministic_runs, largest_gap
from che_bench.config import RunConfig, make_config
from che_bench.errors import one_line
from che_bench.eval.evaluation import length_accuracies, use_evaluation_budget
from che_bench.model.architectures import TRANSFORMER
from che_bench.model.base import BenchModel
from che_bench.model.encoder import Encoder
from che_bench.run.device import configure_numerics, resolve_device
from che_bench.run.packing import AUTO, resolve_width, training_bytes_per_member
from che_bench.run.runner import build_pack_model
from che_bench.settings import BY_NAME
from che_bench.train.loop import sync_every_for

Record = Callable[[dict[str, Any]], None]
MIB = 2**20
ROOT = Path(__file__).resolve().parents[1]
#: The paper encoder's table cell (its training, the pack of 30) and the task every
#: architecture evaluates; the state-tracking models train on their protocol's task.
CELL = ("missing_duplicate_string", "kerple", 3)
STATE_TRACKING_TASK = "parity_check"
STATE_TRACKING_MODELS = ("gated_deltanet", "mlstm")
#: The cuda tests that the self-test repeats (the test_cuda tests calling the whole of it
#: or its check (a)); pytest -m cuda runs the others.
REPEATED_BY_SELFTEST = ("test_cuda_agrees_with_the_cpu", "test_the_selftest_passes_on_cuda")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What the steps measure: timed training steps, the evaluated length and pack widths,
    the pack's members and steps, the deterministic runs' steps, the self-test's checks."""

    training_steps: int
    eval_length: int
    eval_members: tuple[int, ...]
    pack_members: int
    pack_steps: int
    deterministic_steps: int
    selftest_checks: tuple[str, ...]


FULL = Sizes(300, 500, (1, 4), 30, 100, 100, (*(check[0] for check in CHECKS), SPEED))
REHEARSAL = Sizes(3, 12, (1, 4), 3, 3, 3, ("h",))


def _sizes(rehearse: bool) -> Sizes:
    return REHEARSAL if rehearse else FULL


def _preset(name: str, rehearse: bool) -> str:
    return "smoke" if rehearse else protocol_preset(name)


def _configs(name: str, task: str, members: int, rehearse: bool) -> list[RunConfig]:
    """``members`` runs (seeds 0..) of architecture ``name`` on ``task`` under its protocol's
    preset (the transformer: the cell's encoding and kernel); tiny when rehearsing."""
    pe, kernel = CELL[1:] if name == TRANSFORMER else (None, None)
    tiny = rehearse and name != TRANSFORMER  # the smoke preset's transformer is small already
    options = {"arch_options": small_options(name, quick=True)} if tiny else {}
    return [
        make_config(
            task,
            pe,
            kernel,
            _preset(name, rehearse),
            arch=name,
            seed=seed,
            length_seed=0,
            **options,
        )
        for seed in range(members)
    ]


def _device(device: str, rehearse: bool) -> torch.device:
    """``device`` resolved, TF32 off (che-bench's default numerics); one torch thread when
    rehearsing (as che-bench's runs on a CPU), torch's default otherwise (the self-test's
    CPU side uses every core of a GPU machine)."""
    if rehearse:
        torch.set_num_threads(1)
    configure_numerics(tf32=False)
    return resolve_device(device)


def _reset_peak(device: torch.device) -> int:
    """Start a peak-memory reading: the bytes allocated now (a GPU's; 0 elsewhere)."""
    synchronize(device)
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_mib(device: torch.device, baseline: int) -> float | None:
    """The peak above ``baseline`` since ``_reset_peak`` (None off a GPU: no tensor peak)."""
    synchronize(device)
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device) - baseline) / MIB


def selftest(device: str, rehearse: bool, timeout_s: float, record: Record) -> dict[str, Any]:
    """``che-bench selftest`` (quick when rehearsing: only the checks of ``Sizes``), one check
    at a time, each kept as it ends."""
    torch_device = _device(device, rehearse)
    result: dict[str, Any] = {"quick": rehearse, "checks": [], "cases": [], "measurements": []}
    for letter in _sizes(rehearse).selftest_checks:
        report = run_selftest(torch_device, rehearse, only={letter}).to_json()
        result["checks"].append(letter)
        result["cases"] += report["cases"]
        result["measurements"] += report["measurements"]
        result["passed"] = all(case["passed"] for case in result["cases"])
        record(result)
    return result


def _speed_row(label: str, config: RunConfig, steps: int, device: torch.device) -> dict:
    """Seconds per training step of ``config`` over ``steps`` steps timed between device reads
    after one read's worth of warm-up, and the hours of the full preset's steps at that rate."""
    warm_up = sync_every_for(device)
    full_steps = BY_NAME["steps"].default_for(_preset(config.arch, False))
    timed = dataclasses.replace(config, steps=steps)
    _, seconds = timed_training(config.build_task(), [timed], device, warm_up)
    return {
        "model": label,
        "task": config.task,
        "preset": config.preset,
        "batch": config.batch_size,
        "timed_steps": steps,
        "ms_per_step": 1e3 * seconds,
        "full_steps": full_steps,
        "hours": seconds * full_steps / 3600,
    }


def training_speed(device: str, rehearse: bool, timeout_s: float, record: Record) -> dict:
    """Timed training steps of the paper encoder (the cell's) and of the state-tracking
    models, with the hours of their presets' steps extrapolated."""
    torch_device, sizes = _device(device, rehearse), _sizes(rehearse)
    models = [(f"transformer {CELL[1]} + DAPE V2 k={CELL[2]}", TRANSFORMER, CELL[0])]
    models += [(name, name, STATE_TRACKING_TASK) for name in STATE_TRACKING_MODELS]
    rows: list[dict[str, Any]] = []
    for label, name, task in models:
        config = _configs(name, task, 1, rehearse)[0]
        try:
            rows.append(_speed_row(label, config, sizes.training_steps, torch_device))
        except Exception as exc:  # one model's failure leaves the others' figures
            rows.append({"model": label, "error": _line(exc)})
        record({"rows": rows})
    return {"rows": rows, "passed": not any("error" in row for row in rows)}


def _evaluate(model: BenchModel, config: RunConfig, n: int, device: torch.device) -> dict:
    """One evaluation at length ``n`` (``config.eval_samples`` sequences) of ``model`` under
    the evaluation's memory budget, after a warm-up at a short length: ms, peak, the budget
    and what the planner plans in it (``_planned_bytes``)."""
    model.eval()
    use_evaluation_budget(model, device)
    task = model.task
    length_accuracies(model, task, config, min(n, config.train_max_length), device)
    baseline = _reset_peak(device)
    started = time.perf_counter()
    length_accuracies(model, task, config, n, device)
    synchronize(device)
    return {
        "n": n,
        "tokens": task.model_length(n),
        "sequences": config.eval_samples,
        "ms": 1e3 * (time.perf_counter() - started),
        "peak_mib": _peak_mib(device, baseline),
        "budget_mib": model.memory_budget_bytes / MIB,
        "planned_mib": _mib(_planned_bytes(model, n, config.eval_samples, device)),
    }


def _mib(size: int | None) -> float | None:
    return None if size is None else size / MIB


def _planned_bytes(model: BenchModel, n: int, sequences: int, device: torch.device) -> int | None:
    """The memory planner's estimate of what a forward at length ``n`` holds at once: its
    smallest unit (``query_row_bytes``: one query row of one sequence for the transformer's
    maps, one sequence's states for the others) times the units of ``sequences`` sequences,
    capped by the budget (the forward splits beyond it); None for a model that plans
    nothing."""
    task = model.task
    unit = model.query_row_bytes(task.input_length(n), device)
    if unit == 0:
        return None
    rows = task.model_length(n) if isinstance(model, Encoder) else 1
    return min(model.memory_budget_bytes, unit * sequences * rows)


def evaluation(device: str, rehearse: bool, timeout_s: float, record: Record) -> dict:
    """Every built-in architecture evaluated at n = 500 (one sub-batch of its preset's
    evaluation) alone and in a pack of 4: time, peak memory, the planner's budget."""
    torch_device, sizes = _device(device, rehearse), _sizes(rehearse)
    rows: list[dict[str, Any]] = []
    for name in built_in_architectures():
        for members in sizes.eval_members:
            row: dict[str, Any] = {"architecture": name, "members": members}
            try:
                configs = _configs(name, CELL[0], members, rehearse)
                one_batch = dataclasses.replace(configs[0], eval_samples=configs[0].eval_batch_size)
                model = build_pack_model(configs[0].build_task(), configs).to(torch_device)
                row.update(_evaluate(model, one_batch, sizes.eval_length, torch_device))
            except Exception as exc:  # out of memory, say: the other rows go on
                row["error"] = _line(exc)
            rows.append(row)
            record({"rows": rows})
    return {"rows": rows, "passed": not any("error" in row for row in rows)}


def deterministic(device: str, rehearse: bool, timeout_s: float, record: Record) -> dict:
    """``--deterministic`` twice (CoPE + DAPE V2 k = 3, dropout on, the smoke preset): the
    same losses at every step and the same accuracies at every length?"""
    steps, lengths = _sizes(rehearse).deterministic_steps, "13" if rehearse else "41,500"
    config = make_config(
        "reverse_string", "cope", 3, "smoke", steps=steps, test_lengths=lengths, length_seed=0
    )
    try:
        first, second = (deterministic_runs([config], _device(device, rehearse)) for _ in range(2))
    finally:
        configure_numerics(tf32=False, deterministic=False)
    gaps = {reading: largest_gap(first, second, reading) for reading in ("loss", "accuracy")}
    statuses = [result.status for result in (*first, *second)]
    return {
        "steps": steps,
        "test_lengths": lengths,
        "statuses": statuses,
        "largest_loss_difference": gaps["loss"],
        "largest_accuracy_difference": gaps["accuracy"],
        "passed": statuses == ["complete"] * 2 and gaps == {"loss": 0.0, "accuracy": 0.0},
        "errors": [result.error for result in (*first, *second) if result.error],
    }


def cuda_tests(device: str, rehearse: bool, timeout_s: float, record: Record) -> dict:
    """``pytest -m cuda`` on the test files with cuda tests, but those the self-test repeats;
    said so when pytest is not installed."""
    if importlib.util.find_spec("pytest") is None:
        return {"passed": None, "note": "pytest is not installed here: the cuda tests did not run"}
    files = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").glob("test_*.py")
        if "pytest.mark.cuda" in path.read_text()
    )
    deselect = " and ".join(f"not {name}" for name in REPEATED_BY_SELFTEST)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "cuda",
        "-k",
        deselect,
        *files,
    ]
    record({"command": shlex.join(command)})
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}  # this che-bench
    try:  # ends before the step's own timeout, so that its output is kept
        done = subprocess.run(
            command,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=max(1.0, timeout_s - 10),
            env=environment,
        )
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return {
            "command": shlex.join(command),
            "passed": False,
            "summary": "timed out",
            "output_tail": output[-3000:],
        }
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    # Every test skipped (no GPU seen) is no verdict: "not run", not "passed".
    ran = done.returncode != 0 or " passed" in summary
    return {
        "command": shlex.join(command),
        "returncode": done.returncode,
        "summary": summary,
        "passed": done.returncode == 0 if ran else None,
        **({} if ran else {"note": "no cuda test ran: each was skipped (see the summary)"}),
        "output_tail": (done.stdout + done.stderr)[-3000:],
    }


def pack(device: str, rehearse: bool, timeout_s: float, record: Record) -> dict:
    """A pack of 30 of the cell (paper preset) trained 100 steps (timed after one device
    read's warm-up), then evaluated at n = 500 (one sub-batch per member), against the
    planner: ``--pack auto``'s bytes per member and width, the evaluation's budget."""
    torch_device, sizes = _device(device, rehearse), _sizes(rehearse)
    configs = _configs(TRANSFORMER, CELL[0], sizes.pack_members, rehearse)
    result: dict[str, Any] = {
        "members": len(configs),
        "steps": sizes.pack_steps,
        "cell": "/".join(map(str, CELL)),
        "preset": configs[0].preset,
    }
    if torch_device.type == "cuda":  # the planner measures on a GPU only
        per_member = training_bytes_per_member(configs[0], torch_device)
        result["planner_mib_per_member"] = per_member / MIB
        result["planner_mib"] = len(configs) * per_member / MIB
        result["planner_width"] = resolve_width(AUTO, configs[0], torch_device)
    record(result)
    warm_up = sync_every_for(torch_device)
    timed = [dataclasses.replace(c, steps=max(1, sizes.pack_steps - warm_up)) for c in configs]
    baseline = _reset_peak(torch_device)
    model, seconds = timed_training(configs[0].build_task(), timed, torch_device, warm_up)
    result.update(ms_per_step=1e3 * seconds, train_peak_mib=_peak_mib(torch_device, baseline))
    record(result)
    one_batch = dataclasses.replace(configs[0], eval_samples=configs[0].eval_batch_size)
    evaluated = _evaluate(model, one_batch, sizes.eval_length, torch_device)
    result.update({f"eval_{key}": value for key, value in evaluated.items()}, passed=True)
    return result


def _line(exc: BaseException) -> str:
    """An exception as one line, its type first (an out-of-memory error says so)."""
    return f"{type(exc).__name__}: {one_line(exc)}"
