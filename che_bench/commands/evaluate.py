"""``che-bench evaluate RUN_ID...``: re-evaluate kept models under another protocol."""

from __future__ import annotations

import argparse
import json
import sys

from che_bench import settings
from che_bench.commands.reports import add_store_argument, existing_store
from che_bench.commands.run import (
    add_samples_arguments,
    add_setting_argument,
    check_samples_arguments,
)
from che_bench.errors import CheBenchError

#: Above this many times the run's own evaluation, the estimated cost is stated first ...
STATE_COST_ABOVE = 2.0
#: ... and an evaluation estimated at more than this (at the speed the runs' own evaluation
#: was recorded at), or over CONFIRM_RATIO_ABOVE times it when no speed is known, does not
#: start without --yes.
CONFIRM_SECONDS_ABOVE = 3600.0
CONFIRM_RATIO_ABOVE = 20.0


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
    parser.add_argument("run_ids", nargs="+", metavar="RUN_ID",
                        help="run ids, or any prefixes that name one run each")
    parser.add_argument("--test-lengths", help="e.g. 41:1000, 41:2000:10 or 600,800,1000")
    parser.add_argument("--eval-samples", type=int, help="test sequences per length")
    parser.add_argument("--eval-batch-size", type=int, help="sequences per accuracy sub-batch")
    parser.add_argument("--dropout-at-eval", action=argparse.BooleanOptionalAction, default=None,
                        help="keep dropout on while evaluating (as the reference code does)")
    parser.add_argument("--score-from-42", action=argparse.BooleanOptionalAction, default=None,
                        help="average the score over 42.. like the reference scripts")
    add_samples_arguments(parser, "also write each model's predictions on the first test "
                                  "sequences of every test length (input, target, prediction, "
                                  "mask, per-token correctness), one JSON line each")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--yes", action="store_true",
                        help="start even an evaluation estimated at over an hour per run")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_setting_argument(parser, settings.BY_NAME["deterministic"])
    add_store_argument(parser)
    parser.set_defaults(handler=evaluate_command)


def evaluate_command(args: argparse.Namespace) -> int:
    import torch

    from che_bench.config import RunConfig
    from che_bench.run.kept_models import load_model, models_dir_for
    from che_bench.eval.reevaluation import reevaluate, reevaluation_config
    from che_bench.store.run_prefixes import resolve_run_ids
    from che_bench.run.runner import (
        configure_numerics,
        describe_device,
        resolve_device,
        software_versions,
    )
    from che_bench.store.result_store import describe_protocol

    device = resolve_device(args.device)
    check_samples_arguments(args)
    if args.threads < 1:
        raise CheBenchError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    store = existing_store(args.store, for_writing=True)
    run_ids = resolve_run_ids(store, args.run_ids)
    runs = store.runs(run_ids).set_index("run_id")
    incomplete = [run_id for run_id in run_ids if runs.at[run_id, "status"] != "complete"]
    if incomplete:
        raise CheBenchError(f"run {', '.join(incomplete)} is not complete: nothing to evaluate")

    originals = [RunConfig.from_dict(json.loads(runs.at[run_id, "config"])) for run_id in run_ids]
    changes = {"test_lengths": args.test_lengths, "eval_samples": args.eval_samples,
               "eval_batch_size": args.eval_batch_size, "dropout_at_eval": args.dropout_at_eval,
               "score_from_42": args.score_from_42}
    configs = [reevaluation_config(config, **changes) for config in originals]
    _state_cost(originals, configs, runs, args.yes)
    models_dir = models_dir_for(store.path)
    models = [load_model(models_dir, run_id)[1] for run_id in run_ids]

    configure_numerics(_recorded_tf32(store.run_details(run_ids)), args.deterministic)
    evaluations = reevaluate(models, configs, device, progress=not args.no_progress)
    described = describe_device(device)
    for run_id, original, config, result in zip(run_ids, originals, configs, evaluations):
        protocol = config.evaluation_protocol()
        if protocol == original.evaluation_protocol():
            _compare_with_stored(store, run_id, result)
            continue
        evaluation_id = store.record_evaluation(
            run_id, protocol, score=result.score, train_accuracy=result.train_accuracy,
            per_length=result.per_length, train_per_length=result.train_per_length,
            device=described, versions=software_versions(config), timings={"eval_s": result.seconds},
            exact_score=result.exact_score, train_exact_accuracy=result.train_exact_accuracy,
            exact_per_length=result.exact_per_length,
            train_exact_per_length=result.train_exact_per_length,
        )
        print(f"run {run_id}: evaluation {evaluation_id} ({describe_protocol(protocol)}) on "
              f"{described}: score {result.score:.2%}, in-distribution "
              f"{result.train_accuracy:.2%}, exact match {result.exact_score:.2%}; "
              f"{result.seconds:.0f} s")
    if args.samples is not None:
        from che_bench.eval.predictions import write_samples

        written = write_samples(args.samples, run_ids, models, configs, device,
                                args.samples_per_length)
        print(f"wrote {written} sample predictions to {args.samples}")
    return 0


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

    ratio = max(evaluation_cost(new) / evaluation_cost(old) for old, new in zip(originals, configs))
    if ratio <= STATE_COST_ABOVE:
        return
    timings = [json.loads(text or "{}").get("eval_s") for text in runs["timings"]]
    seconds = max((t for t in timings if t), default=None)
    estimate = "" if seconds is None else f" (~{_duration(ratio * seconds)} at the recorded speed)"
    message = (f"estimated cost: {ratio:,.1f}x the runs' own evaluation per run{estimate}, "
               f"{len(configs)} run(s)")
    too_long = (ratio > CONFIRM_RATIO_ABOVE if seconds is None
                else ratio * seconds > CONFIRM_SECONDS_ABOVE)
    if too_long and not confirmed:
        raise CheBenchError(f"{message}; pass --yes to start it")
    print(f"che-bench: {message}", file=sys.stderr)


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
    curve = dict(zip(stored["length"], stored["accuracy"]))
    differences = [abs(curve[n] - accuracy) for n, accuracy in result.per_length.items()]
    if max(differences) == 0:
        verdict = "reproduces the stored curve exactly"
    else:
        verdict = f"differs from the stored curve by up to {max(differences):.2%}"
    print(f"run {run_id}: the original protocol again: score {result.score:.2%}; {verdict} "
          "(nothing recorded)")
