"""Attention maps of a kept model on one test input, drawn as in DAPE V2's Appendix K.

For one test sequence (sequence ``sample`` of the first evaluation sub-batch at that length:
exactly what the evaluation scored) and one layer, each head's query x key maps of: the raw
scores (q.k / sqrt(d_h) plus the encoding's bias), the DAPE-processed logits (DAPE runs only)
and the softmax probabilities, taken from the forward pass itself
(``Encoder.capture_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from che_bench.config import RunConfig
from che_bench.encodings.base import own_normalisation
from che_bench.errors import CheBenchError
from che_bench.eval.evaluation import seed_for_length
from che_bench.model.encoder import Encoder

MAP_TITLES = {"scores": "scores (q.k + bias)", "logits": "DAPE logits", "probabilities": "softmax"}


@dataclass
class AttentionMaps:
    """One layer's maps ``[H, T, T]`` for one input; ``logits`` is None without DAPE;
    ``weights`` names what the probabilities are (the softmax, or the encoding's own
    normalisation: stick-breaking's weights)."""

    label: str
    scores: np.ndarray
    logits: np.ndarray | None
    probabilities: np.ndarray
    tokens: int
    weights: str = "softmax"


def attention_maps(
    model: Encoder, config: RunConfig, label: str, *, length: int, sample: int, layer: int
) -> AttentionMaps:
    """The maps of ``layer`` for test sequence ``sample`` at ``length`` (model on the CPU)."""
    task = config.build_task()
    task.check_length(length)
    layers = len(model.blocks)
    if not -layers <= layer < layers:
        raise CheBenchError(f"--layer must lie in 0..{layers - 1} (the model has {layers} layers)")
    sub_batch = min(config.eval_batch_size, config.eval_samples)
    if not 0 <= sample < sub_batch:
        raise CheBenchError(f"--sample must lie in 0..{sub_batch - 1} (the first test sub-batch)")
    # As the evaluation draws it: the data, the randomized positions and dropout per length.
    data_rng, seed = seed_for_length(model, config, length)
    batch = task.sample(length, sub_batch, data_rng)
    model.train(config.dropout_at_eval)
    inputs = torch.from_numpy(batch.inputs[sample : sample + 1].copy())
    with torch.random.fork_rng(devices=[]), torch.no_grad(), model.capture_attention() as captured:
        torch.manual_seed(seed)
        draws = model.sample_draws(inputs.shape[-1], evaluating=True)
        seeds = model.sample_dropout_seeds(sub_batch)  # the sub-batch's, as evaluated
        model(
            inputs,
            draws,
            evaluating=True,
            dropout_seeds=None if seeds is None else seeds[:, sample : sample + 1],
        )
    chunks = captured[layer]

    def joined(name: str) -> np.ndarray | None:
        parts = [chunk[name] for chunk in chunks]
        if any(part is None for part in parts):
            return None
        return torch.cat([part for part in parts if part is not None], dim=-2)[0, 0].numpy()

    scores, logits, probabilities = joined("scores"), joined("logits"), joined("probabilities")
    if scores is None or probabilities is None:
        raise CheBenchError("the attention layer recorded no scores or probabilities")
    hook = model.attentions()[layer].hook
    weights = f"{model.encoding.name} weights" if own_normalisation(hook) else "softmax"
    return AttentionMaps(label, scores, logits, probabilities, probabilities.shape[-1], weights)


def plot_attention(
    maps: list[AttentionMaps], heads: list[int], out: str | Path, title: str
) -> Path:
    """A grid: one row per head, for each run its scores, DAPE logits and softmax columns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    total_heads = maps[0].probabilities.shape[0]
    if any(not 0 <= head < total_heads for head in heads):
        raise CheBenchError(f"--heads must lie in 0..{total_heads - 1}")
    columns = [(run, name) for run in maps for name in MAP_TITLES if getattr(run, name) is not None]
    figure, axes = plt.subplots(
        len(heads),
        len(columns),
        squeeze=False,
        figsize=(2.6 * len(columns), 2.4 * len(heads) + 0.6),
    )
    for row, head in enumerate(heads):
        for column, (run, name) in enumerate(columns):
            ax = axes[row, column]
            image = ax.imshow(getattr(run, name)[head], cmap="viridis", interpolation="nearest")
            figure.colorbar(image, ax=ax, fraction=0.046, pad=0.03)
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                title = run.weights if name == "probabilities" else MAP_TITLES[name]
                ax.set_title(f"{run.label}\n{title}", fontsize=8)
            if column == 0:
                ax.set_ylabel(f"head {head}\nquery", fontsize=8)
            if row == len(heads) - 1:
                ax.set_xlabel("key", fontsize=8)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, dpi=110)
    except OSError as exc:
        raise CheBenchError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        plt.close(figure)
    return out
