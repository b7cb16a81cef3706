"""Issue 47's precision probe: a DeltaNet run's kept model (or its checkpoint, while it trains)
evaluated under its own protocol in float32, under bf16 autocast (the xLSTM harness's
validation, ``experiments/main.py``), under bf16 autocast with the delta rule rounded as fla's
chunk kernel rounds (``fla_roundings``: the harness's validation numerics in full) and cast to
bf16 (``eval-chomsky.py``, which drew the authors' per-length figures), without and with fla's
roundings; and, per layer, how close beta = 2 sigmoid(x) comes to 2: under bf16 it rounds to
exactly 2 (a reflection) for x >= 6.25.

    python benchmarks/probe_eval_precision.py STORE RUN_ID [--beta-length N] [--beta-only]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch

from che_bench.eval.evaluation import evaluate
from che_bench.model.base import BenchModel
from che_bench.model.state_tracking.deltanet import DeltaMixer
from che_bench.run.kept_models import load_model
from che_bench.store import ResultStore
from che_bench.store.files import CHECKPOINTS, run_file
from che_bench.train.checkpoints import checkpoint_model


def with_fla_roundings(model: BenchModel) -> BenchModel:
    """``model`` with every DeltaNet mixer rounding as fla's chunk kernel does in bf16."""
    for module in model.modules():
        if isinstance(module, DeltaMixer):
            module.fla_roundings = True
    return model


def bf16_autocast() -> AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16)


#: Each evaluation's (model cast, context).
MODES: dict[
    str, tuple[Callable[[BenchModel], BenchModel], Callable[[], AbstractContextManager]]
] = {
    "float32": (lambda model: model, contextlib.nullcontext),
    "bf16 autocast": (lambda model: model, bf16_autocast),
    "bf16 autocast, fla's roundings": (with_fla_roundings, bf16_autocast),
    "bf16 weights": (lambda model: model.to(torch.bfloat16), contextlib.nullcontext),
    "bf16 weights, fla's roundings": (
        lambda model: with_fla_roundings(model.to(torch.bfloat16)),
        contextlib.nullcontext,
    ),
}


def model_of(store: ResultStore, run_id: str):
    (status,) = store.runs([run_id])["status"]
    config = store.run_configs([run_id])[run_id]
    if status == "complete":
        return config, config.steps, load_model(store.path, run_id)[1]
    step, model = checkpoint_model(run_file(store.path, CHECKPOINTS, run_id), config)
    return config, step, model


def beta_preactivations(config, model, length: int) -> list[torch.Tensor]:
    """Each DeltaNet layer's beta pre-activations on 64 test sequences of ``length``."""
    batch = config.build_evaluation_task().sample(length, 64, np.random.default_rng(0))
    layers = [module for module in model.modules() if hasattr(module, "beta_scale")]
    outputs: list[torch.Tensor] = []
    for layer in layers:
        layer.project.register_forward_hook(lambda m, i, o: outputs.append(o))
    with torch.no_grad():
        model.eval()(torch.from_numpy(batch.inputs.copy()))
    starts = [sum(layer.sizes[:3]) for layer in layers]
    return [
        out[..., s : s + layer.sizes[3]].flatten()
        for layer, out, s in zip(layers, outputs, starts, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store")
    parser.add_argument("run_id")
    parser.add_argument("--beta-length", type=int, default=101)
    parser.add_argument("--beta-only", action="store_true", help="beta's statistics alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config, step, model = model_of(ResultStore(args.store), args.run_id)
    task, cpu = config.build_evaluation_task(), torch.device("cpu")
    for name, (cast, context) in ({} if args.beta_only else MODES).items():
        with context():
            (result,) = evaluate(cast(copy.deepcopy(model)), task, config, cpu, progress=False)
        curve = " ".join(f"{n}:{100 * a:.1f}" for n, a in sorted(result.per_length.items()))
        print(f"step {step}, {name}: score {result.score:.2%}; {curve}")
    for index, x in enumerate(beta_preactivations(config, model, args.beta_length)):
        quantiles = torch.quantile(x, torch.tensor([0.05, 0.5, 0.95, 1.0])).tolist()
        print(
            f"layer {index}: beta's x at n = {args.beta_length}: 5/50/95/100% "
            + ", ".join(f"{q:.2f}" for q in quantiles)
            + f"; share x >= 6.25: {(x >= 6.25).float().mean():.4f}"
        )


if __name__ == "__main__":
    main()
