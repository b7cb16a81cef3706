"""``che-bench selftest --portable-reference``: does this CPU repeat the portable CPU mode's
reference run bit for bit (``che_bench.checks.portable_reference``)?"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from che_bench.errors import CheBenchError
from che_bench.reports.text_tables import print_wrapped

if TYPE_CHECKING:
    from che_bench.checks.portable_reference import Comparison, PortableRun

FLAG = "--portable-reference"


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        FLAG,
        action="store_true",
        help="instead of the device checks: repeat the portable CPU mode's reference run "
        "(che-bench run --task missing_duplicate_string --pe kerple --preset quick --seed 0 "
        "--length-seed 0 --threads 1 --portable-cpu; minutes) in a temporary store and say "
        "whether this CPU computes it bit for bit, and if not by how much per length; with "
        "--json, write this CPU's run in the reference's format; exit 1 if it differs",
    )


def portable_reference_command(args: argparse.Namespace) -> int:
    from che_bench.checks.portable_reference import (
        REFERENCE_ARGUMENTS,
        compare,
        load_reference,
        run_portable,
    )

    given = [
        flag
        for flag, value in (("--device", args.device != "auto"), ("--threads", args.threads))
        if value
    ] + (["--quick"] if args.quick else [])
    if given:
        raise CheBenchError(
            f"{FLAG} runs on the CPU with one thread, as the reference did: leave out "
            f"{', '.join(given)}"
        )
    if args.json is not None and args.json.parent and not args.json.parent.is_dir():
        raise CheBenchError(f"cannot write {args.json}: no directory {args.json.parent}")
    reference = load_reference()
    print_wrapped(
        f"repeating the portable reference: che-bench {' '.join(REFERENCE_ARGUMENTS)} "
        f"(took {_seconds(reference)} on {reference.cpu})"
    )
    measured = run_portable(REFERENCE_ARGUMENTS)
    if args.json is not None:
        args.json.write_text(json.dumps(measured.to_json(), indent=1) + "\n")
    comparison = compare(reference, measured)
    for line in verdict_lines(comparison):
        print_wrapped(line)
    if args.json is not None:
        print_wrapped(f"this CPU's run, in the reference's format: {args.json}")
    return 0 if comparison.identical else 1


def _seconds(run: PortableRun) -> str:
    from che_bench.train.progress import duration_text

    return (
        f"{duration_text(sum(run.seconds.values()))}: train {run.seconds['train_s']:.0f} s, "
        f"eval {run.seconds['eval_s']:.0f} s"
    )


def verdict_lines(comparison: Comparison) -> list[str]:
    """What the check prints: both runs, the verdict, and where they differ, per length."""
    reference, measured = comparison.reference, comparison.measured
    lines = [
        f"{label}: {run.cpu}, {_builds(run)}: score {run.score:.2%}"
        for label, run in (("reference", reference), ("this CPU", measured))
    ]
    compared = f"final weights, logged losses and {comparison.lengths_compared} accuracies"
    if comparison.identical:
        return [*lines, f"bit for bit: this CPU repeats the reference ({compared} identical)"]
    differing = [
        "final weights differ" if not comparison.weights_equal else "final weights equal",
        "logged losses equal"
        if comparison.first_loss_step is None
        else f"logged losses differ from step {comparison.first_loss_step:,}",
        f"{len(comparison.lengths)} of {comparison.lengths_compared} accuracies differ",
    ]
    lines.append(
        f"DIFFERS: this CPU does not repeat the reference ({'; '.join(differing)}; score "
        f"{100 * (measured.score - reference.score):+.2f} points)"
    )
    lines += _difference_table(comparison)
    if comparison.builds:
        builds = ", ".join(
            f"{name} {ours} here, {theirs} there"
            for name, (theirs, ours) in comparison.builds.items()
        )
        lines.append(f"the builds differ ({builds}): the mode repeats only with the same builds")
    elsewhere = comparison.matching_elsewhere()
    if elsewhere:
        lines.append(
            f"this score is the one reported for the same command on {' and '.join(elsewhere)} "
            "(scores only were reported there)"
        )
    return lines


def _builds(run: PortableRun) -> str:
    from che_bench.checks.portable_reference import BUILDS

    return ", ".join(f"{name} {run.versions.get(name, '?')}" for name in BUILDS)


def _difference_table(comparison: Comparison) -> list[str]:
    """The differing accuracies, lengths across: the reference's, this CPU's, the difference
    (percentage points)."""
    from che_bench.reports.text_tables import Column, fit_table

    differences = comparison.lengths
    if not differences:
        return []
    columns = [
        Column("length", key=True),
        *(
            Column(f"{'' if d.split == 'test' else 'train '}{d.length}", right=True)
            for d in differences
        ),
    ]
    rows = [
        ["reference %", *(f"{100 * d.reference:.2f}" for d in differences)],
        ["this CPU %", *(f"{100 * d.measured:.2f}" for d in differences)],
        ["difference", *(f"{100 * (d.measured - d.reference):+.2f}" for d in differences)],
    ]
    return fit_table(columns, rows)
