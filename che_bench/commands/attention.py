"""``che-bench attention RUN_ID --length N --out FILE.png``: a kept model's attention maps."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, cast

from che_bench.commands.common import add_store_argument, existing_store, writable_output
from che_bench.errors import CheBenchError

if TYPE_CHECKING:
    from che_bench.model.encoder import Encoder


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "attention",
        help="draw a kept model's attention maps (scores, DAPE logits, softmax) for one input",
        description="For one test input of the given length (sequence --sample of the first "
        "evaluation sub-batch), draw each head's query x key maps of one layer: the raw "
        "scores (q.k plus the encoding's bias), the DAPE-processed logits for DAPE runs, and "
        "the softmax probabilities, as in DAPE V2's Appendix K. --compare adds a second run.",
    )
    parser.add_argument("run_id", metavar="RUN_ID")
    parser.add_argument("--length", type=int, required=True, help="test length n")
    parser.add_argument("--sample", type=int, default=0, help="which test sequence (default 0)")
    parser.add_argument("--layer", type=int, default=0, help="layer (default 0; -1: the last)")
    parser.add_argument("--heads", default="all", help="comma list of heads, or all (default)")
    parser.add_argument("--compare", metavar="RUN_ID2", help="a second run, side by side")
    parser.add_argument("--out", required=True, help="image file, e.g. attention.png")
    add_store_argument(parser)
    parser.set_defaults(handler=attention_command)


def attention_command(args: argparse.Namespace) -> int:
    from che_bench.eval.attention_maps import attention_maps, plot_attention
    from che_bench.reports.labels import run_encoding_label
    from che_bench.run.kept_models import load_model
    from che_bench.store import resolve_run_ids

    writable_output(args.out, "")
    store = existing_store(args.store)
    run_ids = resolve_run_ids(store, [args.run_id] + ([args.compare] if args.compare else []))
    loaded = [load_model(store.path, run_id) for run_id in run_ids]
    for (config, _), run_id in zip(loaded, run_ids, strict=True):
        if not config.is_transformer:
            raise CheBenchError(
                f"run {run_id} is a {config.arch}: attention maps need a transformer"
            )
    if len({(config.task, str(config.task_params), config.eval_seed) for config, _ in loaded}) > 1:
        raise CheBenchError(
            "--compare needs a run of the same task and evaluation seed "
            "(so that both see the same input)"
        )
    maps = [
        attention_maps(
            cast("Encoder", model),
            config,
            f"{run_encoding_label(config.to_dict())} ({run_id})",
            length=args.length,
            sample=args.sample,
            layer=args.layer,
        )
        for run_id, (config, model) in zip(run_ids, loaded, strict=True)
    ]
    config = loaded[0][0]
    heads = (
        list(range(maps[0].probabilities.shape[0])) if args.heads == "all" else _heads(args.heads)
    )
    title = (
        f"{config.task}, n = {args.length} (T = {maps[0].tokens}), test sequence "
        f"{args.sample}, layer {args.layer}"
    )
    print(f"wrote {plot_attention(maps, heads, args.out, title)}")
    return 0


def _heads(text: str) -> list[int]:
    try:
        heads = [int(part) for part in text.split(",")]
    except ValueError:
        raise CheBenchError(
            f"--heads takes a comma list of head numbers or 'all', got {text!r}"
        ) from None
    return heads
