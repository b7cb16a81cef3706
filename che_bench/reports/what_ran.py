"""The report's "What ran" section: statuses, architectures, models with their options and
parameter counts, presets, steps, devices, CPUs, software, plugins, a re-evaluation's
protocol, and the failed runs with their errors. Every string taken from the store is
HTML-escaped."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

import pandas as pd

from che_bench.cpu import UNKNOWN
from che_bench.plugins import describe_plugins
from che_bench.reports.labels import (
    architecture_summary,
    run_encoding_label,
    run_model_label,
    run_parameters,
)
from che_bench.reports.page import escaped
from che_bench.store import ORIGINAL, ResultStore

#: The keys of a run's recorded versions that describe its CPU (``che_bench.cpu.cpu_facts``),
#: listed apart from the software.
CPU_KEYS = ("cpu", "cpu_capability")


def what_ran_html(store: ResultStore, runs: pd.DataFrame, evaluation: str) -> str:
    """The section's HTML for ``runs`` (``store.runs()`` rows) shown under ``evaluation``."""
    listing = "".join(
        f"<li><b>{escaped(name)}</b>: {escaped(value)}</li>"
        for name, value in _items(store, runs, evaluation)
    )
    failed = runs[runs["status"] == "failed"]
    if failed.empty:
        return f"<ul>{listing}</ul>"
    rows = "".join(
        f'<tr><td class="text">{escaped(run.run_id)}</td><td class="text">{escaped(run.task)}</td>'
        f'<td class="text">{escaped(run_encoding_label(run.config))}</td>'
        f'<td class="num">{escaped(run.seed)}</td><td class="text">{escaped(run.error)}</td></tr>'
        for run in failed.itertuples(index=False)
    )
    return (
        f'<ul>{listing}</ul>\n<h3>Failures</h3>\n<div class="wide"><table id="failures"><thead><tr>'
        '<th class="text">run id</th><th class="text">task</th><th class="text">encoding</th>'
        f'<th>seed</th><th class="text">error</th></tr></thead><tbody>{rows}</tbody></table></div>'
    )


def _items(store: ResultStore, runs: pd.DataFrame, evaluation: str) -> list[tuple[str, str]]:
    finished = runs[runs["status"] != "started"]
    statuses = Counter(runs["status"])
    details = store.run_details(finished["run_id"])
    portable = [bool(details.get(run_id, {}).get("portable_cpu")) for run_id in finished["run_id"]]
    items = [
        (
            "runs",
            ", ".join(
                f"{statuses[status]} {status}" for status in ("complete", "failed", "started")
            ),
        ),
        ("runs per architecture", architecture_summary(runs["config"])),
        ("models (options, parameters)", models(finished, details)),
        ("presets", counts(runs["preset"])),
        ("training steps", counts(runs["steps"])),
        ("devices", counts(finished["device"].fillna("-"))),
        ("CPUs (model, torch kernels)", cpus(finished["versions"], portable)),
        ("software", versions(finished["versions"])),
    ]
    used = [describe_plugins(run) for run in store.run_plugins(finished["run_id"]).values()]
    if any(used):
        items.append(
            ("plugins (version, source hash)", counts(text or "no plugin" for text in used))
        )
    if evaluation != ORIGINAL:
        evaluations = store.evaluations(runs["run_id"])
        evaluations = evaluations[evaluations["evaluation"] == evaluation]
        items += [
            (
                f"evaluation {evaluation}",
                f"{len(evaluations)} runs: {evaluations['protocol'].iloc[0]}",
            ),
            ("evaluation devices", counts(evaluations["device"].fillna("-"))),
            ("evaluation CPUs", cpus(evaluations["versions"])),
            ("evaluation software", versions(evaluations["versions"])),
        ]
    started = (runs["status"] == "started").sum()
    if started:
        items.append(
            (
                "not finished",
                f"{started} started runs have no result (interrupted, or still running)",
            )
        )
    return items


def models(runs: pd.DataFrame, details: dict[str, dict[str, Any]]) -> str:
    """Each model the finished ``runs`` trained, named with its options, and its parameter
    count (one member): ``"fox · gate_bias_init=-2: 412,930 parameters (3)"``."""
    labels = []
    for run_id, config in zip(runs["run_id"], runs["config"], strict=True):
        count = run_parameters(details.get(run_id, {}))
        size = "parameters not recorded" if count is None else f"{count:,} parameters"
        labels.append(f"{run_model_label(config)}: {size}")
    return counts(labels)


def counts(values: Iterable[Any]) -> str:
    """``"paper (12), quick (3)"``: the distinct values, most frequent first, with counts."""
    return ", ".join(f"{value} ({count})" for value, count in Counter(values).most_common()) or "-"


def versions(texts: Iterable[str | None]) -> str:
    """Every package version recorded by the given runs or evaluations (JSON texts), the CPU
    left out (``cpus``)."""
    seen: dict[str, set[str]] = {}
    for text in texts:
        for package, version in _recorded(text).items():
            if package not in CPU_KEYS:
                seen.setdefault(package, set()).add(str(version))
    return (
        ", ".join(
            f"{package} {' / '.join(sorted(versions))}"
            for package, versions in sorted(seen.items())
        )
        or "-"
    )


def cpus(texts: Iterable[str | None], portable: Iterable[bool] | None = None) -> str:
    """Each CPU model the runs or evaluations (their versions' JSON texts) recorded, with the
    instruction set of torch's kernels and, per run in ``portable``, the portable CPU mode:
    ``"AMD EPYC, AVX512 (12), unknown (3)"``; "unknown" for those stored before che-bench
    recorded the CPU."""
    texts = list(texts)
    modes = list(portable) if portable is not None else [False] * len(texts)
    labels = []
    for text, in_portable_mode in zip(texts, modes, strict=True):
        recorded = _recorded(text)
        if not any(key in recorded for key in CPU_KEYS):
            labels.append(UNKNOWN)
            continue
        label = f"{recorded.get('cpu', UNKNOWN)}, {recorded.get('cpu_capability', UNKNOWN)}"
        labels.append(label + (", portable CPU mode" if in_portable_mode else ""))
    return counts(labels)


def _recorded(text: str | None) -> dict[str, Any]:
    """A stored JSON object, or {} where none is stored (NULL)."""
    return json.loads(text) if isinstance(text, str) else {}
