"""``che-bench evaluate RUN_ID...``: re-evaluate kept models under another protocol."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from che_bench.commands.common import (
    add_no_progress_argument,
    add_override_arguments,
    add_runtime_arguments,
    add_samples_arguments,
    add_store_argument,
    check_samples_arguments,
    existing_store,
    overrides_from_args,
    runtime_options_from_args,
    use_threads,
)
from che_bench.errors import CheBenchError
from che_bench.reports.text_tables import print_wrapped

#: Above this many times the run's own evaluation, the estimated cost is stated first ...
STATE_COST_ABOVE = 2.0
#: ... and an evaluation estimated at more than this (at the speed the runs' own evaluation
#: was recorded at), or over CONFIRM_RATIO_ABOVE times it when no speed is known, does not
#: start without --yes.
CONFIRM_SECONDS_ABOVE = 3600.0
CONFIRM_RATIO_ABOVE = 20.0
#: The evaluation settings a re-evaluation can change (the run's own value when not given);
#: their flags are ``che-bench run``'s.
CHANGEABLE_SETTINGS = (
    "test_lengths",
    "eval_samples",
    "eval_batch_size",
    "dropout_at_eval",
    "score_from_42",
    "eval_task_params",
)
#: The runtime options that apply to an evaluation.
RUNTIME_SETTINGS = ("device", "threads", "deterministic", "portable_cpu")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "evaluate",
        help="re-evaluate kept models (longer lengths, more sequences, dropout at evaluation)",
        description="Rebuild the kept models of complete runs and evaluate them again under "
        "another protocol, without training; the result is recorded as an additional "
        "evaluation of each run (see `che-bench evaluations`, and `table/export/plot/report "
        "--evaluation ID`). Unchanged settings keep the run's own; with none changed, the "
        "run's original evaluation is repeated and compared with the stored curve.",
    )
    parser.add_argument(
        "run_ids",
        nargs="+",
        metavar="RUN_ID",
        help="run ids, or any prefixes that name one run each",
    )
    add_override_arguments(
        parser, CHANGEABLE_SETTINGS, title="the evaluation protocol (default: each run's own)"
    )
    add_samples_arguments(
        parser,
        "also write each model's predictions on the first test "
        "sequences of every test length (input, target, prediction, "
        "mask, per-token correctness), one JSON line each",
    )
    parser.add_argument(
        "--checkpoint",
        action="store_true",
        help="evaluate each run's checkpoint instead (a run stopped or still training: its "
        "model at the step it reached); printed per length, nothing recorded",
    )
    parser.add_argument(
        "--yes",
        action="store_true",
        help="start even an evaluation estimated at over an hour per run",
    )
    add_runtime_arguments(parser, RUNTIME_SETTINGS)
    add_no_progress_argument(parser)
    add_store_argument(parser)
    parser.set_defaults(handler=evaluate_command)


def evaluate_command(args: argparse.Namespace) -> int:
    from che_bench.store import resolve_run_ids

    options = runtime_options_from_args(args)
    check_samples_arguments(args)
    store = existing_store(args.store, for_writing=not args.checkpoint)
    run_ids = resolve_run_ids(store, args.run_ids)

    # The arguments and run ids are checked: now torch (``che_bench.run.device``).
    from che_bench.run.device import (
        check_portable_device,
        configure_numerics,
        prepare_deterministic_cublas,
        resolve_device,
    )

    if options.deterministic:
        prepare_deterministic_cublas()
    device = resolve_device(options.device)
    check_portable_device(device, options.portable_cpu)
    use_threads(options)
    recorded_tf32 = _recorded_tf32(store.run_details(run_ids))
    configure_numerics(recorded_tf32, options.deterministic, options.portable_cpu)
    if args.checkpoint:
        models, configs = _evaluate_checkpoints(store, run_ids, args, device, options.progress)
        recorded = []
    else:
        models, configs, recorded = _evaluate_kept_models(
            store, run_ids, args, device, options.progress
        )
    if args.samples is not None:
        from che_bench.eval.predictions import write_samples

        written = write_samples(
            args.samples, run_ids, models, configs, device, args.samples_per_length
        )
        print(f"wrote {written} sample predictions to {args.samples}")
    for evaluation_id in dict.fromkeys(recorded):
        store_flag = f" --store {shlex.quote(args.store)}" if args.store else ""
        print_wrapped(
            f"see evaluation {evaluation_id} with (export, plot and report take --evaluation too):"
        )
        print(f"  che-bench table --evaluation {evaluation_id}{store_flag}")  # whole, to copy
    return 0


def _evaluate_kept_models(store, run_ids: list[str], args, device, progress: bool):
    """Evaluate the kept models of complete runs: record a new protocol's results, or compare
    the original protocol's with the stored curve. Returns the models, their configs and the
    ids of the evaluations recorded."""
    from che_bench.eval.reevaluation import reevaluate
    from che_bench.run.kept_models import load_model

    runs, originals = _complete_runs(store, run_ids)
    configs = _evaluation_configs(originals, runs, args)
    models = [load_model(store.path, run_id)[1] for run_id in run_ids]
    evaluations = reevaluate(models, configs, device, progress=progress)
    recorded = []
    for run_id, original, config, result in zip(
        run_ids, originals, configs, evaluations, strict=False
    ):
        if config.evaluation_protocol() == original.evaluation_protocol():
            _compare_with_stored(store, run_id, result)
        else:
            recorded.append(_record_evaluation(store, run_id, config, result, device))
    return models, configs, recorded


def _evaluate_checkpoints(store, run_ids: list[str], args, device, progress: bool):
    """Evaluate each run's latest checkpoint under its protocol (or the one given) and print
    its per-length accuracies; the store is only read. Returns the models and their
    configs."""
    from che_bench.eval.evaluation import evaluate
    from che_bench.store.files import CHECKPOINTS, run_file
    from che_bench.train.checkpoints import checkpoint_model

    runs, originals = _stored_runs(store, run_ids)
    configs = _evaluation_configs(originals, runs, args)
    models = []
    for run_id, original, config in zip(run_ids, originals, configs, strict=True):
        step, model = checkpoint_model(run_file(store.path, CHECKPOINTS, run_id), original)
        (result,) = evaluate(
            model.to(device), config.build_evaluation_task(), config, device, progress=progress
        )
        print_wrapped(
            f"run {run_id} at step {step:,} of {config.steps:,} (its checkpoint; nothing "
            f"recorded): score {result.score:.2%}, in-distribution {result.train_accuracy:.2%}, "
            f"exact match {result.exact_score:.2%}"
        )
        print("\n".join(_per_length_table(result)))
        models.append(model)
    return models, configs


def _evaluation_configs(originals, runs, args) -> list:
    """The runs' configs under the evaluation settings given (each run's own where not),
    once their cost has been stated or refused (``_state_cost``)."""
    from che_bench.eval.reevaluation import reevaluation_config

    changes = {
        name: value
        for name, value in overrides_from_args(args).items()
        if name in CHANGEABLE_SETTINGS
    }
    configs = [reevaluation_config(config, **changes) for config in originals]
    _state_cost(originals, configs, runs, args.yes)
    return configs


def _per_length_table(result) -> list[str]:
    """The per-length accuracies of ``result``, lengths across, in percent."""
    from che_bench.reports.text_tables import Column, fit_table

    lengths = list(result.per_length)
    columns = [Column("length", key=True), *(Column(str(n), right=True) for n in lengths)]
    rows = [
        [name, *(f"{100 * values[n]:.1f}" for n in lengths)]
        for name, values in (
            ("accuracy %", result.per_length),
            ("exact match %", result.exact_per_length),
        )
    ]
    return fit_table(columns, rows)


def _complete_runs(store, run_ids: list[str]):
    """The stored rows and configs of ``run_ids`` (``_stored_runs``), which must all be
    complete."""
    runs, configs = _stored_runs(store, run_ids)
    incomplete = [run_id for run_id in run_ids if runs.at[run_id, "status"] != "complete"]
    if incomplete:
        raise CheBenchError(f"run {', '.join(incomplete)} is not complete: nothing to evaluate")
    return runs, configs


def _stored_runs(store, run_ids: list[str]):
    """The stored rows (by run id) and the configs of ``run_ids``; a run whose plugin is not
    loaded here is a one-line error naming the plugin it recorded, and one whose plugin
    changed since is named on standard error (its model is rebuilt with the installed code)."""
    from che_bench.config import RunConfig
    from che_bench.reports.unregistered import require_registered
    from che_bench.run.stale import stale_runs

    runs = store.runs(run_ids).set_index("run_id")
    recorded = store.run_plugins(run_ids)
    for run_id in run_ids:
        require_registered(run_id, json.loads(runs.at[run_id, "config"]), recorded[run_id])
    configs = [RunConfig.from_dict(json.loads(runs.at[run_id, "config"])) for run_id in run_ids]
    for run_id, changes in stale_runs(dict(zip(run_ids, configs, strict=True)), store).items():
        print_wrapped(
            f"che-bench: run {run_id} is stale: {changes}; its model is rebuilt with the "
            "installed plugin",
            sys.stderr,
        )
    return runs, configs


def _record_evaluation(store, run_id: str, config, result, device) -> str:
    """Record a re-evaluation under a new protocol and say what it scored; its id."""
    from che_bench.run.device import describe_device
    from che_bench.run.provenance import software_versions
    from che_bench.store import describe_protocol

    protocol = config.evaluation_protocol()
    described = describe_device(device)
    evaluation_id = store.record_evaluation(
        run_id,
        protocol,
        result,
        device=described,
        versions=software_versions(config, device),
        timings={"eval_s": result.seconds},
    )
    print_wrapped(
        f"run {run_id}: evaluation {evaluation_id} ({describe_protocol(protocol)}) on "
        f"{described}: score {result.score:.2%}, in-distribution "
        f"{result.train_accuracy:.2%}, exact match {result.exact_score:.2%}, pooled error "
        f"{pooled_error_text(result.pooled_score)}; {result.seconds:.0f} s"
    )
    return evaluation_id


def pooled_error_text(pooled_score: float | None) -> str:
    """1 - the pooled accuracy (errors / scored positions of all test sequences; flip-flop's
    read error), in percent with enough digits for rare errors."""
    return "-" if pooled_score is None else f"{1 - pooled_score:.4%}"


def _recorded_tf32(details: dict[str, dict]) -> bool:
    """Whether the runs trained with TF32 (recorded on GPUs only; absent means off): they
    are re-evaluated with the same numerics."""
    used = {bool(run.get("tf32", False)) for run in details.values()}
    if len(used) > 1:
        raise CheBenchError("these runs trained with and without --tf32: evaluate them apart")
    return used.pop()


def _state_cost(originals, configs, runs, confirmed: bool) -> None:
    """Say what an evaluation far costlier than the run's own will take, and refuse one far
    beyond it without --yes."""
    from che_bench.eval.reevaluation import evaluation_cost

    ratio = max(
        evaluation_cost(new) / evaluation_cost(old)
        for old, new in zip(originals, configs, strict=False)
    )
    if ratio <= STATE_COST_ABOVE:
        return
    # (a started run has no timings: NULL, NaN in the frame)
    timings = [json.loads(text).get("eval_s") for text in runs["timings"] if isinstance(text, str)]
    seconds = max((t for t in timings if t), default=None)
    estimate = "" if seconds is None else f" (~{_duration(ratio * seconds)} at the recorded speed)"
    message = (
        f"estimated cost: {ratio:,.1f}x the runs' own evaluation per run{estimate}, "
        f"{len(configs)} run(s)"
    )
    too_long = (
        ratio > CONFIRM_RATIO_ABOVE if seconds is None else ratio * seconds > CONFIRM_SECONDS_ABOVE
    )
    if too_long and not confirmed:
        raise CheBenchError(f"{message}; pass --yes to start it")
    print_wrapped(f"che-bench: {message}", sys.stderr)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:,.1f} h"


def _compare_with_stored(store, run_id: str, result) -> None:
    """The run's original protocol again: say whether the kept model reproduces its curve."""
    stored = store.per_length([run_id])
    stored = stored[stored["split"] == "test"]
    curve = dict(zip(stored["length"], stored["accuracy"], strict=False))
    differences = [abs(curve[n] - accuracy) for n, accuracy in result.per_length.items()]
    if max(differences) == 0:
        verdict = "reproduces the stored curve exactly"
    else:
        verdict = f"differs from the stored curve by up to {max(differences):.2%}"
    print_wrapped(
        f"run {run_id}: the original protocol again: score {result.score:.2%}; {verdict} "
        "(nothing recorded)"
    )
