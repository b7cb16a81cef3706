"""Issue 44 item 17: the command line checks its arguments before it imports torch (seconds
on a busy machine), and imports it only for work that needs it."""

import json
import os
import subprocess
import sys

import pytest

#: Runs ``che_bench.cli.main`` on the arguments and prints its exit code and whether torch
#: was imported (``sys.modules``), whatever ``main`` printed.
PROBE = """
import json, sys
from che_bench.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def probe(*arguments: str) -> dict:
    environment = {**os.environ, "CHE_BENCH_NO_PLUGINS": "1"}  # installed plugins import torch
    completed = subprocess.run(
        [sys.executable, "-c", PROBE, *arguments],
        capture_output=True,
        text=True,
        env=environment,
        check=False,
    )
    return json.loads(completed.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("arguments", "code"),
    [
        (["--help"], 0),
        (["run", "--help"], 0),
        (["sweep", "--help"], 0),
        (["run", "--task", "parity_check", "--no-such-flag"], 2),  # argparse's refusal
        (["run", "--task", "parity_check", "--steps", "many"], 2),
        (["run", "--task", "parity_check", "--pack", "0"], 2),  # the command's own check
        (["sweep", "no_such_suite"], 2),
        (["tasks"], 0),  # a listing that needs no model
    ],
)
def test_arguments_are_checked_without_importing_torch(arguments, code):
    assert probe(*arguments) == {"code": code, "torch": False}


def test_the_probe_sees_torch_when_a_command_imports_it():
    """The check above can fail: a listing of the encodings (their classes are torch
    modules) does import it."""
    assert probe("encodings") == {"code": 0, "torch": True}
