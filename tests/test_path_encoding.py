"""The ``path`` encoding (PaTH and PaTH-FoX, issue 46) through the encoder's attention layer,
against a float64 computation written plainly here (the Householder products pair by pair,
``tests.test_path_transform.explicit_scores``, and the forget bias by loops), causal and
bidirectional, trained (one chunk of rows) and evaluated in one-row chunks, alone and under
DAPE (k = 1) and DAPE V2 (k = 3); its options, the memory plan, the attention maps and
``check-encoding`` with PaTH-FoX."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from che_bench.checks import conformance
from che_bench.encodings import build_encoding
from che_bench.encodings.path_transform import Householders, prepare_path
from che_bench.errors import CheBenchError
from che_bench.model.attention import Attention
from che_bench.model.dape import DapeProcessor
from che_bench.model.encoder import build_model
from che_bench.tasks import get_task
from tests.test_dape import conv2d_reference
from tests.test_data_dependent_encodings import project
from tests.test_path_transform import explicit_scores, random_factors

HEADS, DIM, LENGTH, BATCH = 2, 8, 7, 2
HEAD_DIM = DIM // HEADS


def layer_of(causal: bool, kernel: int | None = None, **options) -> Attention:
    """One float64 attention layer with ``path``'s first hook (its gates and beta drawn wide,
    so that the bias and the eigenvalues vary) and, with a ``kernel``, a DAPE processor."""
    torch.manual_seed(0)
    encoding = build_encoding(
        "path", dim=DIM, heads=HEADS, layers=1, train_max_tokens=20, members=1, **options
    )
    hook = encoding.layer_hooks()[0]
    with torch.no_grad():
        for side in (hook.left, hook.right):
            for layer in (side.beta_proj, side.forget_proj, side.w_down, side.w_up, side.w_conv):
                if layer is not None:
                    layer.weight.normal_(0.0, 0.5)
    dape = None
    if kernel is not None:
        dape = DapeProcessor(HEADS, kernel, width=4, with_bias=encoding.carries_bias,
                             tril=causal, sequence_bias=hook.sequence_bias)
    return Attention(DIM, HEADS, hook, dape, causal, 1 << 30).double()


def plain_forget_bias(log_left, log_right, scale):
    """``[B, H, T, T]`` from the gates' logs ``[B, H, T]``: summed over (j, i] for j <= i, over
    [i, j) for j > i, times ``scale``."""
    bias = torch.zeros(BATCH, HEADS, LENGTH, LENGTH, dtype=torch.float64)
    for i in range(LENGTH):
        for j in range(LENGTH):
            if j <= i:
                bias[..., i, j] = sum(log_left[..., s] for s in range(j + 1, i + 1))
            else:
                bias[..., i, j] = sum(log_right[..., s] for s in range(i, j))
    return bias * scale


def plain_layer(layer: Attention, x: torch.Tensor, scaled: bool = True) -> torch.Tensor:
    """The layer's output ``[B, T, D]`` for ``x [1, B, T, D]``: the scores from the explicit
    products (the factors from the hook's projections), the forget bias by loops."""
    q, k, v = (
        project(linear, x[0]).view(BATCH, LENGTH, HEADS, HEAD_DIM).transpose(1, 2)
        for linear in (layer.query, layer.key, layer.value)
    )
    left, right = layer.hook.left(x), layer.hook.right(x)
    factors = [Householders(*(t[0].double() for t in f.householders)) for f in (left, right)]
    scores = explicit_scores(q, k, *factors)
    bias = None
    if left.log_forget is not None:
        scale = 1 / math.sqrt(HEAD_DIM) if scaled else 1.0
        bias = plain_forget_bias(left.log_forget[0].double(), right.log_forget[0].double(), scale)
    if layer.dape is not None:
        logits = conv2d_reference(layer.dape, scores[None], None if bias is None else bias[None])[0]
    else:
        logits = scores if bias is None else scores + bias
    if layer.causal:
        logits = logits.masked_fill(torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1), -math.inf)
    out = (torch.softmax(logits, -1) @ v).transpose(1, 2).reshape(BATCH, LENGTH, DIM)
    return project(layer.output, out)


def outputs(layer: Attention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output in training (one chunk) and in evaluation by one-row chunks."""
    trained = layer(x)[0]
    layer.memory_budget_bytes = 1  # one query row per chunk
    with torch.no_grad():
        chunked = layer(x)[0]
    return trained, chunked


def layer_input() -> torch.Tensor:
    return torch.randn(1, BATCH, LENGTH, DIM, generator=torch.Generator().manual_seed(3),
                       dtype=torch.float64)


# The factors are computed in float32 (``path_parameters``), so float32 rounding.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("kernel", [None, 1, 3])
@pytest.mark.parametrize("forget_gate", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_the_layer_equals_the_explicit_products(causal, forget_gate, kernel):
    layer = layer_of(causal, kernel, forget_gate=forget_gate)
    x = layer_input()
    expected = plain_layer(layer, x)
    for got in outputs(layer, x):
        torch.testing.assert_close(got, expected, **TOLERANCE)


def test_path_fox_s_bias_unscaled_as_fox():
    layer = layer_of(False, forget_gate=True, fox_bias_scaled=False)
    x = layer_input()
    expected = plain_layer(layer, x, scaled=False)
    torch.testing.assert_close(layer(x)[0], expected, **TOLERANCE)
    assert not torch.allclose(expected, plain_layer(layer, x, scaled=True), **TOLERANCE)


def test_the_causal_layer_reads_no_right_side():
    """In a causal model the right side's parameters change nothing (they get no gradient)."""
    layer = layer_of(True, forget_gate=True)
    x = layer_input()
    before = layer(x)
    with torch.no_grad():
        for parameter in layer.hook.right.parameters():
            parameter.add_(1.0)
    torch.testing.assert_close(layer(x), before, rtol=0, atol=1e-12)


def test_the_plain_computation_sees_what_it_tests():
    """Not vacuous: the bidirectional scores right of the diagonal are not the causal side's
    mirror image, and the beta range option changes them."""
    x = layer_input()
    bidirectional, narrow = layer_of(False), layer_of(False, negative_eigenvalues=False)
    expected = plain_layer(bidirectional, x)
    assert not torch.allclose(expected, plain_layer(narrow, x), **TOLERANCE)
    factors = bidirectional.hook.left(x).householders
    assert factors.beta.max() > 1 > narrow.hook.left(x).householders.beta.max()


def tiny_model(kernel=None, **options):
    torch.manual_seed(0)
    return build_model(get_task("reverse_string"), "path", kernel, layers=2, dim=16, heads=2,
                       ffn=32, **options)


def test_dape_sees_path_fox_s_bias_per_sequence_and_no_bias_for_plain_path():
    fox = tiny_model(3, forget_gate=True).blocks[0].attention.dape
    assert fox.with_bias and fox.sequence_bias and fox.weight1.shape[2] == 4  # [S; D]: 2H
    assert not tiny_model(3).blocks[0].attention.dape.with_bias


def test_fox_bias_scaled_without_the_gate_is_refused():
    with pytest.raises(CheBenchError, match="fox_bias_scaled applies to PaTH-FoX only"):
        tiny_model(fox_bias_scaled=False)


@pytest.mark.parametrize("forget_gate", [False, True])
def test_the_memory_plan_counts_the_transform_and_its_state(forget_gate):
    plain = build_model(get_task("reverse_string"), "rope", None, layers=2, dim=16, heads=2,
                        ffn=32).query_row_bytes(100)  # 200 tokens, 2 heads
    model = tiny_model(forget_gate=forget_gate)
    hook = model.blocks[0].attention.hook
    maps = hook.score_maps - 1 + hook.extra_maps
    extra = 4 * (maps * 2 * 200 + hook.state_floats(200))
    assert model.query_row_bytes(100) == plain + extra > plain


def test_the_captured_maps_are_path_s_softmax_over_several_blocks():
    model = tiny_model(1).eval()
    model.set_memory_budget(300_000)  # several row chunks in each of the two blocks
    task = get_task("reverse_string")
    inputs = torch.from_numpy(task.sample(40, 1, np.random.default_rng(0)).inputs)  # 80 tokens
    with torch.no_grad():
        whole = model(inputs)
        with model.capture_attention() as captured:
            chunked = model(inputs)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    layer = captured[0]
    assert len(layer) > 2
    weights = torch.cat([chunk["probabilities"] for chunk in layer], -2)[0, 0]
    logits = torch.cat([chunk["logits"] for chunk in layer], -2)[0, 0]
    torch.testing.assert_close(weights, torch.softmax(logits, -1))


@pytest.mark.parametrize("check", ["reference", "bias", "chunks", "pack", "training"])
def test_path_fox_passes_check_encoding_in_a_causal_model(check):
    options = {"forget_gate": True, "fox_bias_scaled": False}
    assert conformance.run_encoding_check(check, "path", options, causal=True) == []


@pytest.mark.parametrize("forget_gate", [False, True])
def test_evaluation_prepared_a_sequence_at_a_time_equals_the_whole(forget_gate, monkeypatch):
    from che_bench.encodings import path

    layer = layer_of(False, 3, forget_gate=forget_gate)
    x = layer_input()
    expected = plain_layer(layer, x)
    monkeypatch.setattr(path, "PREPARE_FLOATS", 1)  # one sequence per part
    with torch.no_grad():
        torch.testing.assert_close(layer(x)[0], expected, **TOLERANCE)


def test_a_chunk_of_rows_forms_the_scores_of_those_rows_only():
    """Two query rows of a sequence of three blocks make no map as large as a block's rows
    over every key (the evaluation's chunks stay within the memory plan)."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 1, 130, 4).unbind(0)
    factors = [random_factors((1, 1), 130, 4) for _ in range(2)]
    prepared = prepare_path(q, k, *factors, block=44)  # three blocks of 44 (132 keys, padded)
    with torch.no_grad(), conformance._largest_tensor() as largest:
        prepared.scores(slice(50, 52))
    assert largest["bytes"] < 4 * 44 * 132, largest
