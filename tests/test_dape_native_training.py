"""DAPE's native kernel in training (issue 28): each chunk's forward and its backward through
f's hidden map give the chunks' own arithmetic's bits (outputs, every gradient, a model's
weights after training steps), on one thread and several; it trains rows longer than two of
its vectors only, and DAPE V2 only; the check that decides where the kernel trains declines a
kernel of other bits, and the switch turns it off; the kernel's backward against autograd
through a conv1d form of f at odd shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from che_bench.model.dape import DapeProcessor, native
from che_bench.model.dape import score_filter as training
from che_bench.model.encoder import build_model
from che_bench.tasks import get_task
from che_bench.train.optimizer import PackOptimizer
from che_bench.train.step import projected_modules, training_step
from tests.conftest import REQUIRED_NATIVE_KERNELS


@pytest.fixture
def kernel_calls(monkeypatch):
    """The native kernel's training calls (forwards and backwards) made from now on."""
    calls = []
    add, backward = native.NativeFilter.add, native.NativeFilter.backward

    def counted_add(self, *arguments, **options):
        calls.extend(["forward"] if options.get("exact") else [])
        return add(self, *arguments, **options)

    def counted_backward(self, *arguments, **options):
        calls.append("backward")
        return backward(self, *arguments, **options)

    monkeypatch.setattr(native.NativeFilter, "add", counted_add)
    monkeypatch.setattr(native.NativeFilter, "backward", counted_backward)
    return calls


@pytest.fixture
def chunks_only(monkeypatch):
    """A context in which training keeps the chunks' arithmetic."""

    def switch_off():
        monkeypatch.setattr(training, "training_kernel", lambda *shape: None)

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


def require_training_kernel(heads, width, kernel):
    """The native kernel where it trains this shape; where it does not, a skip (a failure on
    CI, whose CPUs are checked, for the model's own shapes)."""
    trains = training.training_kernel(heads, width, kernel)
    if trains is None:
        message = f"the native kernel does not give the chunks' bits at {heads, width, kernel}"
        if REQUIRED_NATIVE_KERNELS and (heads, width) == (8, 32):
            pytest.fail(message)
        pytest.skip(message)
    return trains


@pytest.mark.parametrize("kernel", [3, 5, 7])
@pytest.mark.parametrize("variant, with_bias, tril", [
    ("concat_residual", True, False), ("concat_residual", True, True),
    ("add_residual", True, False), ("concat", False, True),
])
@pytest.mark.parametrize("members, shape", [(1, (5, 8, 41, 41)), (2, (3, 8, 9, 37))])
def test_native_training_gives_the_chunks_bits(kernel, variant, with_bias, tril, members, shape,
                                               native_kernel, kernel_calls, chunks_only):
    require_training_kernel(8, 32, kernel)
    kernel_calls.clear()  # (the check's own)
    ours = filter_and_gradients(kernel, variant, with_bias, tril, members, shape)
    assert kernel_calls.count("forward") >= members and kernel_calls.count("backward") >= members
    chunks_only()
    theirs = filter_and_gradients(kernel, variant, with_bias, tril, members, shape)
    for mine, expected in zip(ours, theirs, strict=True):
        assert torch.equal(mine, expected)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_model_trains_to_the_chunks_weights(threads, native_kernel, kernel_calls, chunks_only):
    """Three training steps of a Kerple + DAPE V2 k3 model (the model's widths, few layers)."""
    require_training_kernel(8, 32, 3)
    kernel_calls.clear()  # (the check's own)
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

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        ours = trained()
        assert "backward" in kernel_calls
        chunks_only()
        theirs = trained()
    finally:
        torch.set_num_threads(previous)
    for mine, expected in zip(ours, theirs, strict=True):
        assert torch.equal(mine, expected)


def test_a_kernel_of_other_bits_does_not_train(native_kernel, monkeypatch):
    exact_add = native.NativeFilter.add

    def rounded_otherwise(self, scores, *arguments, **options):
        exact_add(self, scores, *arguments, **options)
        scores.mul_(1 + 2**-20)

    monkeypatch.setattr(native.NativeFilter, "add", rounded_otherwise)
    training._gives_chunks_bits.cache_clear()
    try:
        assert training.training_kernel(8, 32, 3) is None
    finally:
        training._gives_chunks_bits.cache_clear()


def test_the_switch_turns_native_training_off(monkeypatch):
    monkeypatch.setenv(native.SWITCH, "0")
    native.native_filter.cache_clear()
    try:
        assert training.training_kernel(8, 32, 3) is None
    finally:
        native.native_filter.cache_clear()


def test_dape_k1_trains_with_torch_s_products(native_kernel):
    assert training.training_kernel(8, 32, 1) is None


def test_rows_of_two_vectors_or_fewer_train_with_torch_s_products(native_kernel, kernel_calls):
    require_training_kernel(8, 32, 3)
    kernel_calls.clear()  # (the check's own)
    length = 2 * native_kernel.lanes
    filter_and_gradients(3, "concat_residual", True, False, 1, (2, 8, 5, length))
    assert not kernel_calls
    filter_and_gradients(3, "concat_residual", True, False, 1, (2, 8, 5, length + 1))
    assert kernel_calls == ["forward", "backward"]


def conv1d_filter(content, gate_bias, weights):
    """Pre-activation hidden map and f's output (no addend) along the keys, as conv1d."""
    batch, heads, rows, length = content.shape
    weight1, weight2 = weights
    pad = weight1.shape[-1] // 2
    flat = content.permute(0, 2, 1, 3).reshape(batch * rows, heads, length)
    before = F.conv1d(flat, weight1, padding=pad) + gate_bias
    out = F.conv1d(F.leaky_relu(before, 0.01), weight2, padding=pad)
    return before, out.view(batch, rows, heads, length).transpose(1, 2)


@pytest.mark.parametrize("heads, width", [(8, 32), (3, 5), (12, 20)])
@pytest.mark.parametrize("size", [1, 3, 7])
@pytest.mark.parametrize("length", [1, 16, 41])
def test_the_kernel_s_backward_is_f_s(heads, width, size, length, native_kernel):
    """native.backward against autograd: the hidden pre-activation's gradient and the
    content's, from the activated hidden map and the logits' gradient."""
    generator = torch.Generator().manual_seed(size)
    content = torch.randn(2, heads, 3, length, generator=generator, requires_grad=True)
    grad = torch.randn(2, heads, 3, length, generator=generator)
    gate_bias = torch.randn(width, 1, generator=generator)
    weights = (torch.randn(width, heads, size, generator=generator) * 0.3,
               torch.randn(heads, width, size, generator=generator) * 0.3)
    before, out = conv1d_filter(content, gate_bias, weights)
    before.retain_grad()
    out.backward(grad)
    activated = F.leaky_relu(before, 0.01).detach()  # [b*r, D, T]
    as_maps = activated.view(2, 3, width, length).permute(2, 0, 1, 3).contiguous()
    grad_hidden, grad_content = torch.empty_like(as_maps), torch.empty_like(content)
    adjoints = tuple(weight.transpose(0, 1).flip(-1).contiguous() for weight in reversed(weights))
    native_kernel.backward(grad_content, grad, as_maps, grad_hidden, adjoints)
    expected_hidden = before.grad.view(2, 3, width, length).permute(2, 0, 1, 3)
    torch.testing.assert_close(grad_hidden, expected_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_content, content.grad, atol=1e-5, rtol=1e-5)
