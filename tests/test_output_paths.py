"""Every command writing a file (``--out``, ``--samples``) checks it can before any work."""

from __future__ import annotations

import pytest

from che_bench.cli import main
from che_bench.commands.common import writable_output
from che_bench.errors import CheBenchError

#: Each writing command with its output flag, and the label of its error.
WRITERS = [
    (["report"], "--out", "report"),
    (["plot"], "--out", "plot"),
    (["plot", "--prefix"], "--out", "plot"),
    (["curves", "abc"], "--out", "plot"),
    (["export"], "--out", ""),
    (["attention", "abc", "--length", "3"], "--out", ""),
    (["evaluate", "abc"], "--samples", "samples"),
]


@pytest.mark.parametrize(("command", "flag", "what"), WRITERS)
def test_an_unwritable_output_is_refused_before_the_store_is_read(
    command, flag, what, tmp_path, capsys
):
    """The store does not exist: the output's error comes first, so nothing was built."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = blocker / "out.x"
    missing_store = str(tmp_path / "missing.sqlite")
    assert main([*command, flag, str(out), "--store", missing_store]) == 2
    err = capsys.readouterr().err
    label = f"{what} " if what else ""
    assert err == f"che-bench: error: cannot write {label}{out}: Not a directory\n"


def test_writable_outputs_pass_untouched(tmp_path):
    existing = tmp_path / "existing.csv"
    existing.write_text("kept")
    assert writable_output(existing, "plot") == existing
    assert existing.read_text() == "kept"
    nested = tmp_path / "new" / "folders" / "out.png"
    assert writable_output(nested, "plot") == nested
    assert sorted(path.name for path in tmp_path.iterdir()) == ["existing.csv"]


def test_a_directory_is_no_output_file(tmp_path):
    with pytest.raises(CheBenchError, match=f"cannot write report {tmp_path}: Is a directory"):
        writable_output(tmp_path, "report")
