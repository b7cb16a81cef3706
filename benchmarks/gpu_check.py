"""The prepared GPU check: one command that runs what a session with a GPU should check and
measure, each step under its own timeout, and writes a JSON and a Markdown summary.

Steps, in order (``STEPS``; each in a process of its own, forked from this one, killed at
its timeout; a step that fails or hangs is recorded and the next one starts):

1. ``environment``: GPU, driver, CUDA, cuDNN, torch, Python, the commit, che-bench's
   dependencies (those missing said so);
2. ``selftest``: ``che-bench selftest`` on the device, check by check;
3. ``training_speed``: 300 timed training steps of the paper encoder (Kerple + DAPE V2
   k = 3) and of two state-tracking models, their presets' 200k and 20k steps extrapolated;
4. ``evaluation``: every built-in architecture evaluated at n = 500, alone and in a pack of
   4: milliseconds, peak memory against the memory planner's estimate and budget;
5. ``deterministic``: ``--deterministic`` twice: identical?
6. ``cuda_tests``: ``pytest -m cuda`` but for the tests the self-test repeats;
7. ``pack``: a pack of 30 trained 100 steps and evaluated at n = 500, against ``--pack
   auto``'s planner.

The check itself needs the standard library only: where torch or another dependency of
che-bench is missing, the summary says which and the steps that need it fail with the
import's error. The whole check, its start included, keeps within ``--budget`` seconds
(default 460: the 8 minutes a session gives it, less the summaries' writing): a step's
timeout is its own (``STEPS``), or less where the later steps' would not fit otherwise.

    PYTHONPATH=. python3 benchmarks/gpu_check.py --out results/gpu/run   # on a GPU
    python benchmarks/gpu_check.py --device cpu --rehearse --out /tmp/x   # CI's rehearsal

``--rehearse`` runs every step with tiny sizes (and the self-test's check (h) only): it
checks that the check runs, on a CPU in well under a minute; none of its figures means
anything. Exit 0 when every step passed or was not run (the cuda tests where pytest is
missing or every one skips), 1 otherwise; the summaries are written either way.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

#: When the check started: its budget counts from here, imports included.
STARTED, STARTED_AT = time.monotonic(), datetime.now(timezone.utc)

import gpu_check_report  # noqa: E402 (after the clock starts)
from gpu_check_environment import environment  # noqa: E402

#: (step, its longest timeout in seconds on a GPU). A step's timeout is that, or less: what
#: is left of the budget once the later steps' timeouts are set aside.
STEPS: tuple[tuple[str, float], ...] = (
    ("environment", 30),
    ("selftest", 240),
    ("training_speed", 45),
    ("evaluation", 60),
    ("deterministic", 30),
    ("cuda_tests", 75),
    ("pack", 60),
)
#: Seconds for the whole check (its start included): 8 minutes, less the summaries' writing.
BUDGET_S = 460.0
#: A rehearsal's timeout of every step: generous, so that a loaded CPU passes too.
REHEARSAL_TIMEOUT_S = 300.0
#: Below this many seconds left of the budget, a step is skipped rather than started.
LEAST_S = 5.0
PASSED, FAILED, ERROR, TIMED_OUT, SKIPPED, NOT_RUN = (
    "passed", "FAILED", "error", "timed out", "skipped", "not run",
)  # fmt: skip


def load_steps() -> tuple[Any, str]:
    """The steps' module (``gpu_check_steps``, che-bench and torch with it, loaded before any
    step forks), or None and the import's error when something it needs is missing."""
    try:
        import gpu_check_steps
    except Exception as exc:  # ImportError, or a dependency failing as it loads
        return None, f"{type(exc).__name__}: {exc}"
    # torch's first setting of its numerics imports some 900 modules (seconds): once, here,
    # rather than in every step (no CUDA work: flags only).
    gpu_check_steps.configure_numerics(tf32=False)
    return gpu_check_steps, ""


def _child(function: Callable[..., dict], arguments: dict, result: Path, log: Path) -> None:
    """A step's process: its output to ``log``, what it records and returns to ``result``."""
    with open(log, "ab", buffering=0) as output:
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115

    def record(partial: dict, **outcome: Any) -> None:
        temporary = result.with_suffix(".tmp")
        temporary.write_text(json.dumps({"result": partial, **outcome}, default=str))
        temporary.replace(result)

    try:
        record(function(record=record, **arguments), finished=True)
    except BaseException as exc:  # every failure is the step's result
        traceback.print_exc()
        kept = json.loads(result.read_text())["result"] if result.exists() else {}
        record(kept, error=f"{type(exc).__name__}: {str(exc).strip()[:2000]}")


def run_step(
    function: Callable[..., dict], arguments: dict, timeout_s: float, folder: Path, name: str
) -> dict[str, Any]:
    """``function(**arguments, timeout_s=..., record=...)`` in a forked process, killed after
    ``timeout_s`` seconds: its status, seconds, result (what it recorded when it did not
    finish), error and the end of its output."""
    result, log = folder / f"{name}.json", folder / f"{name}.log"
    arguments = {**arguments, "timeout_s": timeout_s}
    process = multiprocessing.get_context("fork").Process(
        target=_child, args=(function, arguments, result, log), name=f"gpu_check {name}"
    )
    started = time.monotonic()
    process.start()
    process.join(timeout_s)
    timed_out = process.is_alive()
    if timed_out:
        process.kill()
        process.join()
    outcome = json.loads(result.read_text()) if result.exists() else {}
    step = {
        "step": name,
        "seconds": round(time.monotonic() - started, 1),
        "timeout_s": round(timeout_s, 1),
        "result": outcome.get("result", {}),
    }
    if timed_out:
        step.update(status=TIMED_OUT, error=f"killed after its timeout of {timeout_s:.0f} s")
    elif "error" in outcome or not outcome.get("finished"):
        step.update(
            status=ERROR,
            error=outcome.get("error")
            or f"its process ended with exit code {process.exitcode} and no result",
        )
    else:
        verdict = step["result"].get("passed", True)
        step["status"] = NOT_RUN if verdict is None else PASSED if verdict else FAILED
    step["output_tail"] = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    return step


def run_all(
    device: str,
    rehearse: bool,
    deadline: float,
    timeouts: dict[str, float],
    on_step: Callable[[dict], None],
) -> list[dict[str, Any]]:
    """Every step in order, each under its timeout (``timeouts``, else ``STEPS``'), less where
    the later steps' timeouts would not fit before ``deadline`` (``time.monotonic``'s) else."""
    steps_module, import_error = load_steps()
    limits = [timeouts.get(name, default) for name, default in STEPS]
    steps = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        for index, (name, _) in enumerate(STEPS):
            left = deadline - time.monotonic()
            room = left - sum(limits[index + 1 :])
            function = environment if name == "environment" else getattr(steps_module, name, None)
            if left < LEAST_S:
                step = {
                    "step": name,
                    "status": SKIPPED,
                    "seconds": 0.0,
                    "error": "the check's budget was spent",
                    "result": {},
                }
            elif function is None:
                step = {
                    "step": name,
                    "status": ERROR,
                    "seconds": 0.0,
                    "result": {},
                    "error": f"che-bench's steps could not be loaded: {import_error}",
                }
            else:
                timeout = min(limits[index], room if room >= LEAST_S else left)
                step = run_step(
                    function, {"device": device, "rehearse": rehearse}, timeout, Path(folder), name
                )
            steps.append(step)
            on_step(step)
    return steps


def write_summaries(summary: dict[str, Any], out: Path) -> list[Path]:
    """``gpu_check.json``, ``gpu_check.md`` and every step's output (``gpu_check.log``) in
    ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "gpu_check.json", out / "gpu_check.md", out / "gpu_check.log"]
    paths[0].write_text(json.dumps(summary, indent=1, default=str) + "\n")
    paths[1].write_text(gpu_check_report.markdown(summary))
    paths[2].write_text(
        "".join(
            f"===== {step['step']} ({step['status']})\n{step.get('output_tail', '')}\n"
            for step in summary["steps"]
        )
    )
    return paths


def parse_timeouts(texts: list[str]) -> dict[str, float]:
    """``STEP=SECONDS`` pairs, each naming a step of ``STEPS``."""
    names, timeouts = [name for name, _ in STEPS], {}
    for text in texts:
        name, _, seconds = text.partition("=")
        if name not in names or not seconds.replace(".", "", 1).isdigit():
            raise SystemExit(
                f"--timeout takes STEP=SECONDS with a step of {', '.join(names)}; got {text!r}"
            )
        timeouts[name] = float(seconds)
    return timeouts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help="folder of the summaries (gpu_check.json, .md, .log); made if needed",
    )
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="tiny sizes: check that the check runs (on a CPU, in seconds)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for the whole check, its start included (default {BUDGET_S:.0f}; "
        "rehearsing: no limit but each step's)",
    )
    parser.add_argument(
        "--timeout",
        action="append",
        default=[],
        metavar="STEP=SECONDS",
        help="a step's timeout (default: STEPS in this file)",
    )
    args = parser.parse_args(argv)
    timeouts = parse_timeouts(args.timeout)
    if args.rehearse:
        timeouts = {name: timeouts.get(name, REHEARSAL_TIMEOUT_S) for name, _ in STEPS}
    budget = args.budget or (len(STEPS) * REHEARSAL_TIMEOUT_S if args.rehearse else BUDGET_S)

    def say(step: dict) -> None:
        line = f"{step['step']}: {step['status']} ({step['seconds']:.0f} s)"
        line += f": {step['error']}" if step.get("error") else ""
        width = max(100, shutil.get_terminal_size().columns)
        print(textwrap.fill(line, width, subsequent_indent="    "), flush=True)

    steps = run_all(args.device, args.rehearse, STARTED + budget, timeouts, say)
    summary = {
        "check": "benchmarks/gpu_check.py",
        "device": args.device,
        "rehearsal": args.rehearse,
        "budget_s": budget,
        "started": STARTED_AT.isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - STARTED, 1),
        "passed": all(step["status"] in (PASSED, NOT_RUN) for step in steps),
        "steps": steps,
    }
    for path in write_summaries(summary, args.out):
        print(f"wrote {path}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
