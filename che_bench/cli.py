"""Entry point of the ``che-bench`` command.

Every subcommand lives in its own module under ``che_bench.commands`` and exposes
``register(subparsers)``, which adds its parser and sets ``handler``; adding a
subcommand is one module plus one entry in ``COMMAND_MODULES``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from che_bench.allocator import keep_freed_memory
from che_bench.cpu import set_portable_environment
from che_bench.errors import CheBenchError
from che_bench.settings import BY_NAME

COMMAND_MODULES = (
    "che_bench.commands.tasks",
    "che_bench.commands.encodings",
    "che_bench.commands.models",
    "che_bench.commands.run",
    "che_bench.commands.reports",
    "che_bench.commands.listings",
    "che_bench.commands.merge",
    "che_bench.commands.sweep",
    "che_bench.commands.evaluate",
    "che_bench.commands.attention",
    "che_bench.commands.checks",
    "che_bench.commands.selftest",
)

#: The exit status of a command whose output was closed by its reader (``che-bench runs |
#: head``): 128 + SIGPIPE, as a program that the closed pipe's signal stopped.
CLOSED_OUTPUT_EXIT = 141
#: The flag of the portable CPU mode, whose environment ``main`` sets before torch starts.
PORTABLE_CPU_FLAG = BY_NAME["portable_cpu"].flag


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, no usage dump
        sys.stderr.write(f"che-bench: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="che-bench",
        description="Length generalization of positional encodings (and DAPE) on the "
        "Chomsky-hierarchy tasks: train at lengths <= 40, test at 41..500.",
    )
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first, so that the encodings and tasks it registers "
        "can be used (repeatable; also after the command, or "
        "CHE_BENCH_PLUGINS=mod1,mod2; installed plugins load by themselves)",
    )
    parser.add_argument(
        "--no-plugins",
        action="store_true",
        help="load no plugin, not even installed ones (also after the command, "
        "or CHE_BENCH_NO_PLUGINS=1): when a broken plugin stops che-bench; "
        "stores holding plugin runs stay readable",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def split_plugin_arguments(argv: list[str]) -> tuple[list[str], bool, list[str]]:
    """(the ``--plugin MODULE`` / ``--plugin=MODULE`` modules, whether ``--no-plugins`` was
    given, the other arguments), wherever they stand: before or after the command."""
    modules, rest = [], []
    no_plugins = False
    arguments = iter(argv)
    for argument in arguments:
        if argument == "--no-plugins":
            no_plugins = True
        elif argument == "--plugin":
            module = next(arguments, None)
            if module is None:
                sys.stderr.write("che-bench: error: argument --plugin: expected one argument\n")
                raise SystemExit(2)
            modules.append(module)
        elif argument.startswith("--plugin="):
            modules.append(argument.split("=", 1)[1])
        else:
            rest.append(argument)
    return modules, no_plugins, rest


def main(argv: list[str] | None = None) -> int:
    """Run the command of ``argv`` (default ``sys.argv[1:]``); its exit status. A command
    whose output's reader went away (``che-bench runs | head``) stops quietly with
    ``CLOSED_OUTPUT_EXIT``."""
    try:
        return _run_command(sys.argv[1:] if argv is None else list(argv))
    except BrokenPipeError:
        _discard_output()
        return CLOSED_OUTPUT_EXIT


def _run_command(argv: list[str]) -> int:
    if PORTABLE_CPU_FLAG in argv:
        # Before anything imports torch: the libraries read these settings when they start.
        set_portable_environment()
    keep_freed_memory()
    from che_bench import plugins

    modules, no_plugins, argv = split_plugin_arguments(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if no_plugins:
            plugins.disable()
        plugins.add_modules(modules)  # also loads the installed and CHE_BENCH_PLUGINS ones
        return int(args.handler(args) or 0)
    except CheBenchError as exc:
        sys.stderr.write(f"che-bench: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        from che_bench.train.progress import say

        say("che-bench: interrupted\n")  # (stderr may be the pipe the Ctrl-C closed)
        return 130


def _discard_output() -> None:
    """Point standard output at /dev/null: its reader is gone, and Python's last flush of
    what is still buffered must not fail again at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor (a captured stream)
        pass
    finally:
        os.close(devnull)


if __name__ == "__main__":
    raise SystemExit(main())
