"""The Markdown summary of ``benchmarks/gpu_check.py`` (the standard library only): the
machine, one row per step, then each step's figures."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

#: Lines of a failed step's output kept in the summary.
TAIL_LINES = 30


def _value(value: Any) -> str:
    """A figure as text: "-" for none, floats to 3 significant digits (thousands grouped)."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += [
        "| " + " | ".join(_value(cell).replace("|", "/") for cell in row) + " |" for row in rows
    ]
    return [*lines, ""]


def _environment(result: dict) -> list[str]:
    gpu = result.get("gpu") or "no GPU (torch sees none)"
    lines = [
        f"- device: {gpu}"
        + (
            f", {result['gpu_memory_gib']} GiB, compute capability {result['compute_capability']}"
            if result.get("gpu")
            else ""
        ),
        f"- driver: {result.get('driver') or 'unknown (no nvidia-smi)'}; CUDA (torch's build): "
        f"{result.get('cuda') or '-'}; cuDNN: {result.get('cudnn') or '-'}",
        f"- torch {result.get('torch') or 'MISSING'} ({result.get('torch_threads', '-')} "
        f"threads), Python {result.get('python')}, che-bench {result.get('che_bench', '-')} at "
        f"{result.get('commit')}",
        f"- CPU: {result.get('cpu')}, {result.get('cpus')} CPUs; {result.get('platform')}",
    ]
    versions = ", ".join(
        f"{name} {entry['version'] or 'MISSING'}"
        for name, entry in result.get("dependencies", {}).items()
        if entry["needed"]
    )
    lines.append(f"- dependencies: {versions}")
    for key in ("device_error", "che_bench_error"):
        if result.get(key):
            lines.append(f"- **{result[key]}**")
    return [*lines, ""]


def _selftest(result: dict) -> list[str]:
    cases = result.get("cases", [])
    failed = [case for case in cases if not case["passed"]]
    lines = [
        f"Checks run: {', '.join(result.get('checks', [])) or 'none'}; "
        f"{len(cases) - len(failed)} of {len(cases)} cases agree.",
        "",
    ]
    if failed:
        lines += _table(
            ["check", "subject", "quantity", "measured", "tolerance", "error"],
            [
                [
                    c["check"],
                    c["subject"],
                    c["quantity"],
                    c["measured"],
                    c["tolerance"],
                    c.get("error") or "",
                ]
                for c in failed
            ],
        )
    if result.get("measurements"):
        lines += _table(
            ["figure (d)", "value", "unit", "kind"],
            [
                [
                    m["name"],
                    m["value"],
                    m["unit"],
                    m["kind"].upper() if m["kind"] == "estimate" else m["kind"],
                ]
                for m in result["measurements"]
            ],
        )
    return lines


def _training_speed(result: dict) -> list[str]:
    return _table(
        [
            "model",
            "task",
            "preset",
            "batch",
            "timed steps",
            "ms / step",
            "preset's steps",
            "hours (extrapolated)",
            "error",
        ],
        [
            [
                row["model"],
                row.get("task"),
                row.get("preset"),
                row.get("batch"),
                row.get("timed_steps"),
                row.get("ms_per_step"),
                row.get("full_steps"),
                row.get("hours"),
                row.get("error", ""),
            ]
            for row in result.get("rows", [])
        ],
    )


def _evaluation(result: dict) -> list[str]:
    return [
        "Peak: the GPU memory allocated above what was allocated before the evaluation; "
        "budget: what the memory planner gives the forward's row chunks or sub-batches (on a "
        "GPU half its free memory); planned: the planner's estimate of what the forward "
        "holds at once (its maps or states, capped by the budget; weights and activations "
        "outside them not counted).",
        "",
        *_table(
            [
                "architecture",
                "members",
                "n (tokens)",
                "sequences",
                "ms",
                "peak MiB",
                "planned MiB",
                "peak / planned",
                "budget MiB",
                "error",
            ],
            [
                [
                    row["architecture"],
                    row["members"],
                    f"{row['n']} ({row['tokens']})" if "n" in row else None,
                    row.get("sequences"),
                    row.get("ms"),
                    row.get("peak_mib"),
                    row.get("planned_mib"),
                    _ratio(row.get("peak_mib"), row.get("planned_mib")),
                    row.get("budget_mib"),
                    row.get("error", ""),
                ]
                for row in result.get("rows", [])
            ],
        ),
    ]


def _ratio(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else value / reference


def _pairs(result: dict, keys: Sequence[str]) -> list[str]:
    return [*(f"- {key}: {_value(result[key])}" for key in keys if key in result), ""]


def _deterministic(result: dict) -> list[str]:
    return _pairs(
        result,
        [
            "steps",
            "test_lengths",
            "statuses",
            "largest_loss_difference",
            "largest_accuracy_difference",
            "errors",
        ],
    )


def _cuda_tests(result: dict) -> list[str]:
    return _pairs(result, ["note", "command", "summary", "returncode"])


def _pack(result: dict) -> list[str]:
    return _pairs(
        result,
        [
            "cell",
            "preset",
            "members",
            "steps",
            "ms_per_step",
            "train_peak_mib",
            "planner_mib",
            "planner_mib_per_member",
            "planner_width",
            "eval_n",
            "eval_sequences",
            "eval_ms",
            "eval_peak_mib",
            "eval_budget_mib",
        ],
    )


SECTIONS: dict[str, Callable[[dict], list[str]]] = {
    "environment": _environment,
    "selftest": _selftest,
    "training_speed": _training_speed,
    "evaluation": _evaluation,
    "deterministic": _deterministic,
    "cuda_tests": _cuda_tests,
    "pack": _pack,
}


def markdown(summary: dict[str, Any]) -> str:
    """The whole summary as Markdown."""
    steps = summary["steps"]
    rehearsal = (
        " (REHEARSAL with tiny sizes: no figure in it means anything)"
        if summary["rehearsal"]
        else ""
    )
    passed = sum(step["status"] == "passed" for step in steps)
    lines = [
        f"# che-bench GPU check{rehearsal}",
        "",
        f"`benchmarks/gpu_check.py --device {summary['device']}`, started "
        f"{summary['started']}: {passed} of {len(steps)} steps passed in "
        f"{summary['seconds']:.0f} s (budget {summary['budget_s']:.0f} s).",
        "",
    ]
    lines += _table(
        ["step", "status", "seconds", "timeout s", "error"],
        [
            [s["step"], s["status"], s["seconds"], s.get("timeout_s"), (s.get("error") or "")[:300]]
            for s in steps
        ],
    )
    for step in steps:
        lines += [f"## {step['step']}: {step['status']}", ""]
        lines += SECTIONS[step["step"]](step.get("result") or {})
        if step["status"] not in ("passed", "not run") and step.get("output_tail"):
            tail = step["output_tail"].splitlines()[-TAIL_LINES:]
            lines += ["Its output, last lines:", "", "```", *tail, "```", ""]
    return "\n".join(lines)
