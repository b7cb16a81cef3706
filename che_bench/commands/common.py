"""Command-line arguments shared by several commands, declared once.

The flags of run settings and runtime options derive from ``che_bench.settings`` (help,
type, default and validator); the store, progress, kept-model and samples flags are declared
here. Commands read them back as ``make_config`` overrides (``overrides_from_args``) and one
``RuntimeOptions`` (``runtime_options_from_args``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from che_bench import settings
from che_bench.commands.key_values import parse_key_values
from che_bench.errors import CheBenchError
from che_bench.run.options import DEFAULT_THREADS, RuntimeOptions
from che_bench.run.trackers import TrackerOptions


def add_setting_argument(parser, setting: settings.Setting) -> None:
    """The command-line flag of one declared setting."""
    if setting.kind == settings.SWITCH and setting.where == settings.RUNTIME:
        parser.add_argument(
            setting.flag, dest=setting.name, action="store_true", default=False, help=setting.help
        )
    elif setting.kind == settings.SWITCH:
        # --X / --no-X; None when neither is given, so that a preset's, a suite's or the
        # task's value is kept.
        parser.add_argument(
            setting.flag,
            dest=setting.name,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=setting.help,
        )
    elif setting.kind == settings.KEY_VALUES:
        parser.add_argument(
            setting.flag,
            dest=setting.name,
            action="append",
            default=[],
            metavar=setting.metavar,
            help=setting.help,
        )
    else:
        # Runtime options have no preset: their flag's default is the declared one.
        parser.add_argument(
            setting.flag,
            dest=setting.name,
            type=setting.kind,
            default=setting.default if setting.where == settings.RUNTIME else None,
            metavar=setting.metavar,
            help=setting.help,
        )


def add_override_arguments(
    parser: argparse.ArgumentParser,
    names: tuple[str, ...] | None = None,
    title: str = "overrides of the preset",
) -> None:
    """The flags that override preset fields (``make_config`` keywords): one per run setting
    of ``che_bench.settings`` that has a flag, or those of ``names``."""
    group = parser.add_argument_group(title)
    for setting in settings.run_settings():
        if setting.flag is not None and (names is None or setting.name in names):
            add_setting_argument(group, setting)


def add_runtime_arguments(
    parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None
) -> None:
    """The flags of the runtime options of ``che_bench.settings`` (how runs execute): all of
    them, or those of ``names``."""
    for setting in settings.settings_where(settings.RUNTIME):
        if names is None or setting.name in names:
            add_setting_argument(parser, setting)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``make_config`` keywords from the override flags (None = keep the preset's value)."""
    overrides = {}
    for setting in settings.run_settings():
        if setting.flag is None or not hasattr(args, setting.name):
            continue
        value = getattr(args, setting.name)
        if setting.kind == settings.KEY_VALUES:
            value = parse_key_values(value, setting.flag) or None
        overrides[setting.name] = value
    return overrides


def runtime_options_from_args(args: argparse.Namespace, **fields: Any) -> RuntimeOptions:
    """The command's ``RuntimeOptions``: its runtime flags (checked by the settings'
    validators), ``--no-progress`` and ``fields`` (directories). A missing tracker extra is
    a one-line error here, before anything runs."""
    values = {
        setting.name: getattr(args, setting.name)
        for setting in settings.settings_where(settings.RUNTIME)
        if hasattr(args, setting.name)
    }
    tensorboard, wandb = values.pop("tensorboard", None), values.pop("wandb", None)
    if tensorboard is not None or wandb is not None:
        values["trackers"] = TrackerOptions(tensorboard=tensorboard, wandb=wandb)
        values["trackers"].check()
    if hasattr(args, "no_progress"):
        values["progress"] = not args.no_progress
    return RuntimeOptions(**values, **fields)


def use_threads(options: RuntimeOptions) -> None:
    """torch's CPU threads in this process: ``--threads``, default ``DEFAULT_THREADS``."""
    import torch

    torch.set_num_threads(options.threads or DEFAULT_THREADS)


def add_store_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        metavar="PATH",
        help="result store (default $CHE_BENCH_STORE or results/che-bench.sqlite; "
        "checkpoints and kept models go beside it, in NAME.checkpoints/ and NAME.models/)",
    )


def add_no_progress_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (results are still printed, one line each)",
    )


def add_keep_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-keep-model",
        action="store_true",
        help="do not keep the trained weights (default: NAME.models/<run id>.pt beside "
        "the store NAME.sqlite, for `che-bench evaluate` and `attention`)",
    )


def add_rerun_stale_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rerun-stale",
        action="store_true",
        help="rerun complete runs whose plugin (task, encoding or model) is installed now at "
        "another version or with other source code than they recorded; their stored results "
        "are replaced (default: such runs are named and kept)",
    )


def add_samples_arguments(parser: argparse.ArgumentParser, help: str) -> None:
    """``--samples FILE`` (``che_bench.eval.predictions``) and how many sequences per length."""
    parser.add_argument("--samples", metavar="FILE.jsonl", help=help)
    parser.add_argument(
        "--samples-per-length",
        type=int,
        default=8,
        metavar="N",
        help="sequences per length with --samples (default 8)",
    )


def check_samples_arguments(args: argparse.Namespace) -> None:
    """A bad ``--samples-per-length``, or a ``--samples`` file that cannot be written, is
    refused before anything runs."""
    if args.samples is not None:
        from che_bench.eval.predictions import check_samples_per_length

        check_samples_per_length(args.samples_per_length)
        writable_output(args.samples, "samples")


def writable_directory(path: Path, what: str) -> Path:
    """Create ``path`` if needed and check it is writable, or raise a one-line error."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheBenchError(f"cannot create {what} {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CheBenchError(f"{what} {path} is not writable")
    return path


def writable_output(out: str | Path, what: str) -> Path:
    """``out`` once checked writable, before any work goes into its content: an existing
    ``out`` is opened for appending (its content untouched); a new one's folder, or the
    nearest existing folder above it (the writers create the missing ones), takes a
    temporary file. Raises the writer's own one-line error, ``cannot write {what} {out}:
    {reason}``, that it would otherwise raise only after the work."""
    path = Path(out)
    try:
        if not path.exists():
            folder = next(parent for parent in path.parents if parent.exists())
            with tempfile.NamedTemporaryFile(dir=folder):
                pass
        elif path.is_file() or path.is_dir():  # not a pipe, whose opening waits for a reader
            with open(path, "a"):
                pass
    except OSError as exc:
        label = f"{what} " if what else ""
        raise CheBenchError(f"cannot write {label}{out}: {exc.strerror or exc}") from None
    return path


def run_directories(
    store, *, keep_models: bool, checkpoint_dir: Path | None = None
) -> dict[str, Path | None]:
    """``RuntimeOptions`` fields of a writer of ``store``: where its runs checkpoint (the
    store's own folder unless ``checkpoint_dir``: then checked writable) and keep their
    models. The checkpoints an older che-bench left for the store's started runs in the
    folder every store of the directory shared come into the store's own first."""
    from che_bench.run.kept_models import models_dir_for
    from che_bench.run.sweep import checkpoint_dir_for
    from che_bench.store.files import adopt_shared_checkpoints

    if checkpoint_dir is None:
        runs = store.runs()
        adopt_shared_checkpoints(store.path, list(runs.loc[runs["status"] == "started", "run_id"]))
        checkpoint_dir = checkpoint_dir_for(store)
    return {
        "checkpoint_dir": writable_directory(checkpoint_dir, "checkpoint directory"),
        "models_dir": models_dir_for(store.path) if keep_models else None,
    }


def existing_store(path: str | None, *, for_writing: bool = False):
    """Open an existing store, read-only unless ``for_writing`` (reading never modifies it);
    a missing file is an error rather than a new empty store."""
    from che_bench.store import ResultStore, default_store_path

    resolved = Path(path) if path else default_store_path()
    if not resolved.exists():
        raise CheBenchError(
            f"no result store at {resolved} (run `che-bench run` first or pass --store)"
        )
    return ResultStore(resolved, read_only=not for_writing)


def add_arch_filter_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--arch",
        action="append",
        dest="archs",
        metavar="ARCH",
        help="only runs of this architecture (repeatable): transformer, lstm, ...",
    )


def runs_of_arch_filter(store, archs: list[str] | None) -> list[str] | None:
    """The ids of the store's runs of ``archs`` (``--arch``), None (every run) without."""
    if archs is None:
        return None
    from che_bench.reports.labels import runs_of_architectures

    return runs_of_architectures(store.runs(), archs)
