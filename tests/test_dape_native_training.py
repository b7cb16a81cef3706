"""DAPE V2 trained by the native kernel (``native_training``): outputs and every gradient equal
the chunks' arithmetic within float32 rounding, and a model trains to nearby weights; the
kernel's parts give the same bits on any number of threads; with the scores as f's content,
training's logits are evaluation's bit for bit; it trains every row length, DAPE V2 only (k <=
7), and the switch turns it off; its backward and its weights' gradients against autograd
through a conv1d form of f at odd shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from che_bench.model.dape import DapeProcessor, native, native_training
from che_bench.model.dape import score_filter as training
from che_bench.model.encoder import build_model
from che_bench.tasks import get_task
from che_bench.train.optimizer import PackOptimizer
from che_bench.train.step import projected_modules, training_step


@pytest.fixture
def kernel_calls(monkeypatch):
    """The native kernel's training calls (weight gradients) made from now on."""
    calls = []
    weight_grads = native.NativeFilter.weight_grads

    def counted(self, *arguments, **options):
        calls.append("weight_grads")
        return weight_grads(self, *arguments, **options)

    monkeypatch.setattr(native.NativeFilter, "weight_grads", counted)
    return calls


@pytest.fixture
def chunks_only(monkeypatch):
    """A context in which training keeps the chunks' arithmetic."""

    def switch_off():
        monkeypatch.setattr(training, "training_kernel", lambda kernel: None)

    return switch_off


def filter_and_gradients(kernel, variant, with_bias, tril, members, shape, width=32):
    """f's logits and every gradient (scores, bias, parameters) for a fixed upstream gradient."""
    heads = shape[1]
    torch.manual_seed(kernel)
    processor = DapeProcessor(heads, kernel, width=width, variant=variant, with_bias=with_bias,
                              tril=tril, members=members)
    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(members, *shape, generator=generator, requires_grad=True)
    bias = (torch.randn(1, 1, *shape[1:], generator=generator, requires_grad=True)
            if with_bias else None)
    upstream = torch.randn(members, *shape, generator=generator)
    logits = processor(scores, bias)
    inputs = [scores, *([bias] if with_bias else []), *processor.parameters()]
    return [logits.detach(), *torch.autograd.grad(logits, inputs, upstream)]


def assert_rounding_close(ours, theirs):
    """Equal within float32 rounding of sums of a few thousand terms, relative to each
    tensor's largest value."""
    for mine, expected in zip(ours, theirs, strict=True):
        scale = expected.abs().max().clamp_min(1e-12)
        assert (mine - expected).abs().max() <= 1e-5 * scale


@pytest.mark.parametrize("kernel", [3, 5, 7])
@pytest.mark.parametrize("variant, with_bias, tril", [
    ("concat_residual", True, False), ("concat_residual", True, True),
    ("add_residual", True, False), ("concat", False, True),
])
@pytest.mark.parametrize("members, shape", [
    (1, (5, 8, 41, 41)), (2, (3, 8, 9, 37)), (1, (2, 8, 3, 48)), (1, (1, 8, 2, 100)),
])
def test_native_training_equals_the_chunks(kernel, variant, with_bias, tril, members, shape,
                                           native_kernel, kernel_calls, chunks_only):
    ours = filter_and_gradients(kernel, variant, with_bias, tril, members, shape)
    assert kernel_calls.count("weight_grads") >= 2 * members
    chunks_only()
    theirs = filter_and_gradients(kernel, variant, with_bias, tril, members, shape)
    assert_rounding_close(ours, theirs)


def test_a_model_trains_to_nearby_weights(native_kernel, kernel_calls, chunks_only):
    """Three training steps of a Kerple + DAPE V2 k3 model (the model's widths, few layers)."""
    task = get_task("parity_check")
    batch = task.sample(36, 8, np.random.default_rng(0))
    inputs, targets = (torch.from_numpy(array)[None] for array in (batch.inputs, batch.targets))

    def trained():
        torch.manual_seed(0)
        model = build_model(task, "kerple", 3, layers=2)
        optimiser = PackOptimizer(model, [1e-3], (0.9, 0.999), 1e-8, max_norm=1.0)
        for _ in range(3):
            training_step(model, optimiser, inputs, targets, projected_modules(model))
        return [parameter.detach().clone() for parameter in model.parameters()]

    ours = trained()
    assert kernel_calls
    chunks_only()
    theirs = trained()
    changed = 0
    for mine, expected in zip(ours, theirs, strict=True):
        # Adam moves a weight by about lr = 1e-3 a step whatever its gradient's size, so
        # rounding in a gradient near 0 may move it by a fraction of a step.
        torch.testing.assert_close(mine, expected, atol=3e-4, rtol=1e-4)
        changed += not torch.equal(mine, expected)
    assert changed  # the kernel's own rounding, not the chunks' arithmetic


def kernel_parts(threads, native_kernel):
    """The kernel's training calls on fixed maps with ``threads`` torch threads: the logits
    (with a residual, onto the content), then every gradient the backward gives."""
    generator = torch.Generator().manual_seed(3)
    content, grad = torch.randn(2, 5, 8, 7, 41, generator=generator)
    weight1, weight2 = (torch.randn(32, 8, 3, generator=generator) * 0.3,
                        torch.randn(8, 32, 3, generator=generator) * 0.3)
    bias1 = torch.randn(32, generator=generator)
    residual = torch.randn(1, 8, 7, 41, generator=generator)
    logits = torch.empty_like(content)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        addend = native_training.member_forward(
            native_kernel, logits, content, None, (weight1, bias1, weight2), residual)
        gradients = native_training.member_backward(
            native_kernel, grad, content, None, (weight1, weight2, addend), (True, False),
            plus_grad=True)
    finally:
        torch.set_num_threads(previous)
    return [logits, *(value for value in gradients if value is not None)]


def test_the_kernel_s_parts_give_the_same_bits_on_any_thread_count(native_kernel):
    for one, two in zip(kernel_parts(1, native_kernel), kernel_parts(2, native_kernel),
                        strict=True):
        assert torch.equal(one, two)


def test_the_switch_turns_native_training_off(monkeypatch):
    monkeypatch.setenv(native.SWITCH, "0")
    native.native_filter.cache_clear()
    try:
        assert training.training_kernel(3) is None
    finally:
        native.native_filter.cache_clear()


def test_dape_k1_and_kernels_over_7_train_with_torch_s_products(native_kernel):
    assert training.training_kernel(1) is None
    assert training.training_kernel(9) is None
    assert training.training_kernel(7) is native_kernel


@pytest.mark.parametrize("length", [1, 16, 17, 33])
def test_rows_of_every_length_train_with_the_kernel(length, native_kernel, kernel_calls):
    filter_and_gradients(3, "concat_residual", True, False, 1, (2, 8, 5, length))
    assert kernel_calls == ["weight_grads", "weight_grads"]


def conv1d_filter(content, gate_bias, weights):
    """Pre-activation hidden map and f's output (no addend) along the keys, as conv1d."""
    batch, heads, rows, length = content.shape
    weight1, weight2 = weights
    pad = weight1.shape[-1] // 2
    flat = content.permute(0, 2, 1, 3).reshape(batch * rows, heads, length)
    before = F.conv1d(flat, weight1, padding=pad) + gate_bias
    out = F.conv1d(F.leaky_relu(before, 0.01), weight2, padding=pad)
    return before, out.view(batch, rows, heads, length).transpose(1, 2)


def padded(rows, span, lanes):
    """``[rows, C, T]`` rows zero-padded to ``span`` keys, with zeros past both ends."""
    out = native_training._padded_rows(rows, (1, rows.shape[0]), rows.shape[1], span, lanes)[0]
    out.zero_()
    out[..., : rows.shape[-1]] = rows
    return out


@pytest.mark.parametrize("heads, width", [(8, 32), (3, 5), (12, 20)])
@pytest.mark.parametrize("size", [1, 3, 7])
@pytest.mark.parametrize("length", [1, 16, 41])
@pytest.mark.parametrize("plus_grad", [False, True])
def test_the_kernel_s_backward_is_f_s(heads, width, size, length, plus_grad, native_kernel):
    """native.backward_rows and weight_grads against autograd: the recomputed hidden map, its
    pre-activation's gradient, the content's (plus the logits' with ``plus_grad``) and both
    weights', from the content and the logits' gradient."""
    generator = torch.Generator().manual_seed(size)
    content = torch.randn(2, heads, 3, length, generator=generator, requires_grad=True)
    grad = torch.randn(2, heads, 3, length, generator=generator)
    gate_bias = torch.randn(width, 1, generator=generator)
    weights = (torch.randn(width, heads, size, generator=generator).mul(0.3).requires_grad_(),
               torch.randn(heads, width, size, generator=generator).mul(0.3).requires_grad_())
    before, out = conv1d_filter(content, gate_bias, weights)
    before.retain_grad()
    out.backward(grad)
    lanes, span = native_kernel.lanes, native_training.span_of(length, size, native_kernel.lanes)
    hidden, grad_hidden = native_training._padded_rows(content, (2, 6), width, span, lanes)
    content_rows, grad_rows = torch.empty(2, 6, heads, span).unbind()
    grad_content = torch.empty_like(content)
    adjoints = native.Convolutions.of(
        *(w.detach().transpose(0, 1).flip(-1) for w in reversed(weights)))
    as_hidden, as_maps = native_training._as_hidden, native_training._as_maps
    written = (as_hidden(hidden, 2), as_maps(content_rows, 2), as_hidden(grad_hidden, 2),
               as_maps(grad_rows, 2))
    forward = (content.detach(), gate_bias[:, :, None],
               native.Convolutions.of(*(w.detach() for w in weights)))
    backward = native_kernel.backward_rows(grad_content, grad, forward, adjoints, written,
                                           plus_grad)
    backward(slice(0, 2), slice(0, 3))
    close = {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(hidden[..., :length], F.leaky_relu(before, 0.01), **close)
    torch.testing.assert_close(grad_hidden[..., :length], before.grad, **close)
    expected_content = content.grad + grad if plus_grad else content.grad
    torch.testing.assert_close(grad_content, expected_content, **close)
    for rows in (hidden, grad_hidden, content_rows, grad_rows):
        assert not rows[..., length:].any()  # the zero padding weight_grads relies on
    grad_weight2, grad_weight1 = torch.zeros(heads, width, size), torch.zeros(heads, width, size)
    native_kernel.weight_grads(grad_weight2, grad_rows, hidden, 1)
    native_kernel.weight_grads(grad_weight1, content_rows, grad_hidden, -1)
    torch.testing.assert_close(grad_weight2, weights[1].grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(grad_weight1.transpose(0, 1), weights[0].grad, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kernel", [3, 7])
def test_training_logits_are_evaluation_s_bit_for_bit(kernel, native_kernel):
    """With the scores as f's content, training's logits are the kernel's scores + (residual
    + f), as evaluation's tiles compute them."""
    torch.manual_seed(kernel)
    processor = DapeProcessor(8, kernel, width=32, with_bias=True)
    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(1, 3, 8, 41, 41, generator=generator, requires_grad=True)
    bias = torch.randn(1, 1, 8, 41, 41, generator=generator)
    trained = processor(scores, bias)
    evaluated = scores.detach().clone()
    with torch.no_grad():
        tiles = processor.tile_filter(0, bias, slice(0, 41), evaluated.shape[1:])
        for tile in tiles.tiles:
            logits = evaluated[0, tile.batch, :, tile.rows].contiguous()
            evaluated[0, tile.batch, :, tile.rows] = tiles.add(logits, tile)
    assert torch.equal(trained.detach(), evaluated)
