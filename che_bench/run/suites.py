"""Suite files: a TOML description of a grid of runs, expanded into validated RunConfigs.

The format (every key, its default, an example) is on the documentation's sweeps page,
``docs/sweeps.md`` ("Suite files"; a test checks that it names every key accepted here and
that its example expands). A suite names tasks, architectures, encodings, DAPE kernels,
seeds and learning rates; the grid is their product (per encoding, optionally with its own
kernels), every point built through ``make_config`` with the suite's preset and overrides.
``"all"`` expands from the registries, so new tasks and encodings join such suites without
edits. The whole grid is validated when the suite is expanded, before anything runs: an
unknown task or encoding, or an impossible combination, is one CheBenchError naming the
suite file.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from che_bench.config import TRANSFORMER
from che_bench.errors import CheBenchError
from che_bench.registry import normalise_name

if TYPE_CHECKING:  # imported when a suite is expanded: torch loads only then
    from che_bench.config import RunConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, from PyPI, before it joined the standard library
    import tomli as tomllib

#: Where bare suite names (``che-bench sweep smoke``) are looked up, relative to the cwd.
SUITE_DIR = Path("tasks")

_TOP_LEVEL_KEYS = {
    "name",
    "description",
    "preset",
    "tasks",
    "architectures",
    "encodings",
    "kernels",
    "seeds",
    "learning_rates",
    "overrides",
    "resources",
    "best_over",
}
_RESOURCE_KEYS = {"num_cpus", "num_gpus"}
#: The keys of a table entry of ``tasks``, ``architectures`` and ``encodings`` besides ``name``.
_ENTRY_KEYS = {
    "tasks": {"params"},
    "architectures": {"options"},
    "encodings": {"options", "kernels"},
}
#: Run settings a suite sets through its grid keys, never in ``[overrides]``.
_GRID_SETTINGS = ("seed", "lr", "task_params", "pe_options", "arch", "arch_options")
_ALL = "all"
_NO_KERNEL = "none"


@dataclass(frozen=True)
class TaskEntry:
    """One task of a suite with its constructor parameters."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EncodingEntry:
    """One encoding of a suite: its options and, if given, its own kernel list."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    kernels: tuple[int | None, ...] | None = None


@dataclass(frozen=True)
class ArchitectureEntry:
    """One architecture of a suite with its options (``transformer``: none; its runs are
    the suite's encodings x kernels)."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def is_transformer(self) -> bool:
        return normalise_name(self.name) == TRANSFORMER


@dataclass(frozen=True)
class Resources:
    """What one run asks of a Ray cluster; ``num_gpus=None`` means 'decide from the cluster'."""

    num_cpus: float = 1.0
    num_gpus: float | None = None


@dataclass(frozen=True)
class Suite:
    """A parsed suite file; ``configs()`` expands and validates its grid."""

    name: str
    path: Path
    description: str
    preset: str
    tasks: tuple[TaskEntry, ...]
    architectures: tuple[ArchitectureEntry, ...]
    encodings: tuple[EncodingEntry, ...]
    kernels: tuple[int | None, ...]
    seeds: tuple[int, ...]
    learning_rates: tuple[float, ...] | None
    overrides: dict[str, Any]
    resources: Resources
    #: Architecture options whose values its tables take the best over (``reports.best_of``).
    best_over: tuple[str, ...] = ()

    def configs(self) -> list[RunConfig]:
        """Every run of the grid as a RunConfig, in a stable order, without duplicates.

        Order: seed, then learning rate, then task, architecture, encoding, kernel, so a
        sweep that stops part-way has filled whole tables for its first seeds. Raises
        CheBenchError (naming the suite file and the grid point) for any invalid point.
        """
        cells = [
            (task, architecture, encoding, kernel)
            for task in self._expanded_tasks()
            for architecture in self.architectures
            for encoding, kernel in self._encoding_cells(architecture)
        ]
        learning_rates = self.learning_rates or (None,)
        configs: dict[str, RunConfig] = {}
        for seed in self.seeds:
            for lr in learning_rates:
                for cell in cells:
                    config = self._cell_config(*cell, seed, lr)
                    configs.setdefault(config.run_id(), config)
        return list(configs.values())

    def _encoding_cells(
        self, architecture: ArchitectureEntry
    ) -> list[tuple[EncodingEntry | None, int | None]]:
        """The (encoding, kernel) pairs of an architecture: the transformer's grid, or none."""
        if not architecture.is_transformer:
            return [(None, None)]
        return [
            (encoding, kernel)
            for encoding in self._expanded_encodings()
            for kernel in (encoding.kernels if encoding.kernels is not None else self.kernels)
        ]

    def _cell_config(
        self,
        task: TaskEntry,
        architecture: ArchitectureEntry,
        encoding: EncodingEntry | None,
        kernel: int | None,
        seed: int,
        lr: float | None,
    ) -> RunConfig:
        from che_bench.config import make_config  # torch-heavy; only when expanding

        overrides = dict(self.overrides, seed=seed, arch=architecture.name)
        if architecture.options:
            overrides["arch_options"] = dict(architecture.options)
        if lr is not None:
            overrides["lr"] = lr
        if task.params:
            overrides["task_params"] = dict(task.params)
        if encoding is not None and encoding.options:
            overrides["pe_options"] = dict(encoding.options)
        pe = encoding.name if encoding is not None else None
        try:
            return make_config(task.name, pe=pe, kernel=kernel, preset=self.preset, **overrides)
        except CheBenchError as exc:
            point = _describe_point(task, architecture, encoding, kernel, seed, lr)
            raise CheBenchError(f"{self.path}: {point}: {exc}") from None

    def _expanded_tasks(self) -> list[TaskEntry]:
        if any(entry.name == _ALL for entry in self.tasks):
            from che_bench.tasks import list_tasks

            named = [entry for entry in self.tasks if entry.name != _ALL]
            listed = {entry.name for entry in named}
            return named + [TaskEntry(name) for name in list_tasks() if name not in listed]
        return list(self.tasks)

    def _expanded_encodings(self) -> list[EncodingEntry]:
        if any(entry.name == _ALL for entry in self.encodings):
            from che_bench.encodings import list_encodings

            named = [entry for entry in self.encodings if entry.name != _ALL]
            listed = {entry.name for entry in named}
            registered = [encoding.name for encoding in list_encodings()]
            return named + [EncodingEntry(name) for name in registered if name not in listed]
        return list(self.encodings)


def resolve_suite_path(suite: str | Path) -> Path:
    """A suite file path, or a bare name looked up as ``tasks/NAME.toml``."""
    path = Path(suite)
    if path.is_file():
        return path
    named = SUITE_DIR / f"{suite}.toml"
    if path.suffix == "" and named.is_file():
        return named
    available = sorted(p.stem for p in SUITE_DIR.glob("*.toml")) if SUITE_DIR.is_dir() else []
    hint = f" (suites in {SUITE_DIR}/: {', '.join(available)})" if available else ""
    raise CheBenchError(f"no suite file {str(suite)!r}{hint}")


def load_suite(suite: str | Path) -> Suite:
    """Parse and check a suite file (structure only; ``Suite.configs()`` validates the grid)."""
    path = resolve_suite_path(suite)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise CheBenchError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise CheBenchError(f"{path}: cannot read suite: {exc.strerror}") from None
    return parse_suite(data, path)


def parse_suite(data: dict[str, Any], path: Path) -> Suite:
    """Build a Suite from already-parsed TOML ``data`` (``path`` names it in errors)."""

    def fail(message: str) -> CheBenchError:
        return CheBenchError(f"{path}: {message}")

    unknown = sorted(set(data) - _TOP_LEVEL_KEYS)
    if unknown:
        raise fail(
            f"unknown key(s) {', '.join(unknown)}; expected {', '.join(sorted(_TOP_LEVEL_KEYS))}"
        )
    if "tasks" not in data:
        raise fail("missing 'tasks'")
    preset = data.get("preset", "quick")
    if not isinstance(preset, str):
        raise fail("'preset' must be a string")
    overrides = data.get("overrides", {})
    if not isinstance(overrides, dict):
        raise fail("'overrides' must be a table")
    for reserved in _GRID_SETTINGS:
        if reserved in overrides:
            raise fail(f"set {reserved!r} through the suite's grid keys, not [overrides]")
    try:
        architectures = _architectures(data.get("architectures", [TRANSFORMER]))
        if any(entry.is_transformer for entry in architectures) and "encodings" not in data:
            raise fail("missing 'encodings' (the transformer's)")
        return Suite(
            name=str(data.get("name", path.stem)),
            path=path,
            description=str(data.get("description", "")),
            preset=preset,
            tasks=tuple(_task_entry(item) for item in _as_list(data["tasks"], "tasks")),
            architectures=architectures,
            encodings=tuple(
                _encoding_entry(item) for item in _as_list(data.get("encodings", []), "encodings")
            )
            if "encodings" in data
            else (),
            kernels=_kernels(data.get("kernels", [_NO_KERNEL]), "kernels"),
            seeds=_seeds(data.get("seeds", [0])),
            learning_rates=_learning_rates(data.get("learning_rates")),
            overrides=dict(overrides),
            resources=_resources(data.get("resources", {})),
            best_over=_best_over(data.get("best_over", [])),
        )
    except CheBenchError as exc:
        raise fail(str(exc)) from None


def _describe_point(
    task: TaskEntry,
    architecture: ArchitectureEntry,
    encoding: EncodingEntry | None,
    kernel: int | None,
    seed: int,
    lr: float | None,
) -> str:
    task_text = task.name + (f"{task.params}" if task.params else "")
    lr_text = "" if lr is None else f", lr {lr:g}"
    if encoding is None:
        return f"task {task_text}, architecture {architecture.name}, seed {seed}{lr_text}"
    kernel_text = "no DAPE" if kernel is None else f"kernel {kernel}"
    return f"task {task_text}, encoding {encoding.name}, {kernel_text}, seed {seed}{lr_text}"


def _as_list(value: Any, key: str) -> list:
    if isinstance(value, (str, dict)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise CheBenchError(f"{key!r} must be a non-empty list")
    return value


def _named_table(item: Any, key: str, allowed: set[str]) -> tuple[str, dict[str, Any]]:
    if isinstance(item, str):
        return item, {}
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise CheBenchError(f"each entry of {key!r} is a name or a table with a 'name'")
    unknown = sorted(set(item) - allowed - {"name"})
    if unknown:
        raise CheBenchError(f"{key!r} entry {item['name']!r}: unknown key(s) {', '.join(unknown)}")
    return item["name"], item


def _task_entry(item: Any) -> TaskEntry:
    name, table = _named_table(item, "tasks", _ENTRY_KEYS["tasks"])
    params = table.get("params", {})
    if not isinstance(params, dict):
        raise CheBenchError(f"task {name!r}: 'params' must be a table")
    return TaskEntry(name, dict(params))


def _architectures(value: Any) -> tuple[ArchitectureEntry, ...]:
    entries = []
    for item in _as_list(value, "architectures"):
        name, table = _named_table(item, "architectures", _ENTRY_KEYS["architectures"])
        options = table.get("options", {})
        if not isinstance(options, dict):
            raise CheBenchError(f"architecture {name!r}: 'options' must be a table")
        entries.append(ArchitectureEntry(name, dict(options)))
    return tuple(entries)


def _encoding_entry(item: Any) -> EncodingEntry:
    name, table = _named_table(item, "encodings", _ENTRY_KEYS["encodings"])
    options = table.get("options", {})
    if not isinstance(options, dict):
        raise CheBenchError(f"encoding {name!r}: 'options' must be a table")
    kernels = _kernels(table["kernels"], f"kernels of {name}") if "kernels" in table else None
    return EncodingEntry(name, dict(options), kernels)


def _kernels(value: Any, key: str) -> tuple[int | None, ...]:
    kernels: list[int | None] = []
    for item in _as_list(value, key) if not isinstance(value, int) else [value]:
        if item == _NO_KERNEL:
            kernels.append(None)
        elif isinstance(item, int) and not isinstance(item, bool):
            kernels.append(item)
        else:
            raise CheBenchError(f'{key!r}: {item!r} is neither "none" nor an integer kernel size')
    return tuple(dict.fromkeys(kernels))


def _seeds(value: Any) -> tuple[int, ...]:
    seeds = _as_list(value, "seeds") if not isinstance(value, int) else [value]
    if not all(
        isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0 for seed in seeds
    ):
        raise CheBenchError("'seeds' must be non-negative integers")
    return tuple(dict.fromkeys(seeds))


def _learning_rates(value: Any) -> tuple[float, ...] | None:
    if value is None:
        return None
    rates = _as_list(value, "learning_rates") if not isinstance(value, (int, float)) else [value]
    if not all(
        isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0 for lr in rates
    ):
        raise CheBenchError("'learning_rates' must be positive numbers")
    return tuple(dict.fromkeys(float(lr) for lr in rates))


def _best_over(value: Any) -> tuple[str, ...]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise CheBenchError("'best_over' must be a list of architecture option names")
    return tuple(dict.fromkeys(names))


def _resources(value: Any) -> Resources:
    if not isinstance(value, dict):
        raise CheBenchError("'resources' must be a table")
    unknown = sorted(set(value) - _RESOURCE_KEYS)
    if unknown:
        raise CheBenchError(
            f"[resources]: unknown key(s) {', '.join(unknown)}; expected num_cpus, num_gpus"
        )
    for key, amount in value.items():
        if not isinstance(amount, (int, float)) or isinstance(amount, bool) or amount < 0:
            raise CheBenchError(f"[resources]: {key} must be a non-negative number")
    num_gpus = value.get("num_gpus")
    return Resources(
        num_cpus=float(value.get("num_cpus", 1.0)),
        num_gpus=None if num_gpus is None else float(num_gpus),
    )
