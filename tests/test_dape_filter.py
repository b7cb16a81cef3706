"""DAPE's filter at evaluation, tile by tile in cache (issue 28), in both implementations
(the ``filter_implementation`` fixture): with ``chunks`` the logits of the training path's
filter (``ScoreFilter`` into a fresh map, then a fresh softmax) bit for bit, with the native
kernel within float32 rounding; both within float32 rounding of a plain conv2d form, for every
encoding, k = 1, 3, 5, 7, causal or not, packs of several members. Also the training path's
gradients against the conv2d form (kernels wider than short rows too) and the benchmark's
filter rates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from che_bench.encodings import list_encodings
from che_bench.model.dape import VARIANTS, DapeProcessor
from che_bench.model.encoder import build_model
from che_bench.tasks import get_task
from tests.test_dape import conv2d_reference

TINY = {"layers": 2, "dim": 16, "heads": 2, "ffn": 32}
ENCODINGS = [cls.name for cls in list_encodings()]
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_model.py"


def processor_and_maps(kernel, variant, with_bias, tril, members=3, bias_members=1):
    torch.manual_seed(kernel)
    processor = DapeProcessor(3, kernel, width=5, variant=variant, with_bias=with_bias,
                              tril=tril, members=members)
    scores = torch.randn(members, 2, 3, 7, 9)
    bias = torch.randn(bias_members, 1, 3, 7, 9) if with_bias else None
    return processor, scores, bias


def tiled_logits(processor, scores, bias, rows=None):
    """The logits of every member's ``TileFilter``, tile by tile (each tile's scores copied
    out contiguous, as the attention computes them, and written back)."""
    members, _, _, num_rows, _ = scores.shape
    rows = rows or slice(0, num_rows)
    logits = scores.clone()
    for member in range(members):
        tile_filter = processor.tile_filter(member, bias, rows, scores.shape[1:])
        for tile in tile_filter.tiles:
            view = logits[member, tile.batch, :, tile.rows]
            view.copy_(tile_filter.add(view.contiguous(), tile))
    return logits


@pytest.mark.parametrize("kernel", [1, 3, 5, 7])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("tril", [False, True])
@pytest.mark.parametrize("bias_members", [1, 3])
def test_the_tile_filter_gives_the_training_filter_s_logits(
    kernel, variant, with_bias, tril, bias_members, filter_implementation
):
    processor, scores, bias = processor_and_maps(kernel, variant, with_bias, tril,
                                                 bias_members=bias_members)
    rows = slice(4, 11)  # a row chunk's rows: where tril's diagonal falls
    with torch.no_grad():
        ours = tiled_logits(processor, scores, bias, rows)
        training = processor(scores, bias, rows)  # ScoreFilter into a fresh map
        reference = conv2d_reference(processor, scores, bias, rows)
    assert_as_before(ours, training, filter_implementation)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_bytes", [1, 4 * 5 * 9 * 3, 4 * 5 * 9 * 7 * 2])
def test_the_tile_filter_is_exact_in_any_cache_tiles(monkeypatch, cache_bytes,
                                                     filter_implementation):
    """One row at a time, 3 rows, whole sequences."""
    import che_bench.model.dape.kernel as kernel_module

    monkeypatch.setattr(kernel_module, "CACHE_CHUNK_BYTES", cache_bytes)
    for kernel, variant, with_bias in ((3, "concat_residual", True), (7, "add_residual", False)):
        processor, scores, bias = processor_and_maps(kernel, variant, with_bias, False)
        with torch.no_grad():
            torch.testing.assert_close(tiled_logits(processor, scores, bias),
                                       conv2d_reference(processor, scores, bias),
                                       atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [7])
@pytest.mark.parametrize("tril", [False, True])
def test_training_gradients_at_kernel_seven_match_the_conv2d_form(kernel, tril):
    """k = 1, 3, 5: test_dape.test_matches_conv2d_reference_values_and_gradients."""
    processor, scores, bias = processor_and_maps(kernel, "concat_residual", True, tril,
                                                 bias_members=3)
    scores.requires_grad_(True)
    bias.requires_grad_(True)
    inputs = [scores, bias, *processor.parameters()]
    upstream = torch.randn_like(scores)
    ours = processor(scores, bias)
    reference = conv2d_reference(processor, scores, bias)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(torch.autograd.grad(ours, inputs, upstream),
                            torch.autograd.grad(reference, inputs, upstream), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", [9, 11])
@pytest.mark.parametrize("length", [1, 2, 4, 6])
def test_kernels_wider_than_the_row_match_the_conv2d_form(kernel, length,
                                                          filter_implementation):
    """Short training rows, where some taps' shifted keys lie wholly past the row's ends."""
    torch.manual_seed(kernel)
    processor = DapeProcessor(3, kernel, width=5, with_bias=True)
    scores = torch.randn(1, 2, 3, length, length, requires_grad=True)
    bias = torch.randn(1, 1, 3, length, length, requires_grad=True)
    inputs, upstream = [scores, bias, *processor.parameters()], torch.randn_like(scores)
    ours, reference = processor(scores, bias), conv2d_reference(processor, scores, bias)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(torch.autograd.grad(ours, inputs, upstream),
                            torch.autograd.grad(reference, inputs, upstream), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        tiled = tiled_logits(processor, scores.detach(), bias.detach())
    torch.testing.assert_close(tiled, reference.detach(), atol=1e-5, rtol=1e-5)


def evaluate(model, inputs, draws, capture=False):
    """The model's logits (the maps built in place unless ``capture``)."""
    with torch.no_grad():
        if not capture:
            return model(inputs, draws)
        with model.capture_attention():
            return model(inputs, draws)


@pytest.mark.parametrize("pe", ENCODINGS)
@pytest.mark.parametrize("causal", [False, True])
def test_every_encoding_evaluates_as_before_and_as_the_conv2d_form(
    pe, causal, filter_implementation
):
    """A pack of 2 members in row chunks (a small memory budget): attention in tiles gives the
    logits of the explicit maps (which capturing takes; bit for bit with ``chunks``), and those
    of the grouped convolutions (an independent form of f) within float32 rounding."""
    task = get_task("reverse_string")
    torch.manual_seed(0)
    model = build_model(task, pe, 3, members=2, causal=causal, memory_budget_bytes=1 << 14,
                        **TINY).eval()
    inputs = torch.from_numpy(task.sample(9, 3, np.random.default_rng(0)).inputs)
    draws = model.sample_draws(inputs.shape[-1], evaluating=True)
    ours = evaluate(model, inputs, draws)
    assert_as_before(ours, evaluate(model, inputs, draws, capture=True), filter_implementation)
    for block in model.blocks:
        block.attention.dape.implementation = "convolution"
    torch.testing.assert_close(ours, evaluate(model, inputs, draws), atol=1e-5, rtol=1e-5)


def assert_as_before(ours, explicit, implementation):
    """Bit for bit the explicit maps' (or the training filter's) logits with ``chunks``;
    within rounding natively."""
    if implementation == "chunks":
        assert torch.equal(ours, explicit)
    torch.testing.assert_close(ours, explicit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pe", ["alibi", "kerple", "t5", "fire", "none"])
@pytest.mark.parametrize("kernel", [1, 5, 7])
def test_each_kernel_evaluates_as_before(pe, kernel, filter_implementation):
    task = get_task("reverse_string")
    torch.manual_seed(kernel)
    model = build_model(task, pe, kernel, members=2, memory_budget_bytes=1 << 14, **TINY).eval()
    inputs = torch.from_numpy(task.sample(9, 3, np.random.default_rng(1)).inputs)
    ours = evaluate(model, inputs, None)
    assert_as_before(ours, evaluate(model, inputs, None, capture=True), filter_implementation)


@pytest.mark.parametrize("pe", ENCODINGS)
def test_every_encoding_trains_with_the_conv2d_form_s_gradients(pe):
    task = get_task("reverse_string")
    torch.manual_seed(0)
    model = build_model(task, pe, 3, members=2, causal=pe == "kerple", **TINY)
    inputs = torch.from_numpy(task.sample(5, 3, np.random.default_rng(0)).inputs)
    draws = model.sample_draws(inputs.shape[-1], evaluating=False)
    gradients = []
    for implementation in ("chunks", "convolution"):
        for block in model.blocks:
            block.attention.dape.implementation = implementation
        model.zero_grad()
        torch.manual_seed(1)  # the same dropout
        model(inputs, draws).square().sum().backward()
        gradients.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for ours, theirs in zip(*gradients, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_the_benchmark_prints_the_filter_s_rate_and_the_peak():
    done = subprocess.run(
        [sys.executable, str(BENCH), "train", "--encodings", "kerple", "--kernels", "none", "3",
         "--tasks", "parity_check", "--train-length", "3", "--batch", "2", "--steps", "1",
         "--threads", "1"],
        capture_output=True, text=True, check=True, timeout=600)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("fp32 peak of one core: nominal ")
    assert "MHz" in lines[0] and "measured" in lines[0]
    plain, dape = lines[-2].split(), lines[-1].split()
    assert plain[2] == "plain" and plain[-2:] == ["-", "-"]
    assert dape[2] == "k3" and float(dape[-3]) > 0  # the filter's GFLOP per step
