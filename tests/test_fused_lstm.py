"""The one-member LSTM's fused kernel as cuDNN runs it, simulated on a CPU (issue 26, items 1
and 4): ``torch.lstm`` is replaced by a stand-in with cuDNN's two constraints, a backward that
refuses a forward run in inference mode and a per-call copy (with its warning) of weights that
are not views of one buffer in cuDNN's layout."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import che_bench.model.recurrent.base as base
from che_bench.model.recurrent import build_recurrent, rnn
from che_bench.tasks import get_task

#: cuDNN's warning when the weights it is given are not one buffer (aten/src/ATen/native/
#: cudnn/RNN.cpp: try_get_weight_buf fails, _cudnn_rnn copies them).
COPY_WARNING = "RNN module weights are not part of single contiguous chunk of memory"
#: A layout with a gap before every weight, as a cuDNN version that aligns them could have.
GAP = 5


class _RefuseBackward(torch.autograd.Function):
    """Identity whose backward fails as cuDNN's does after an inference-mode forward."""

    @staticmethod
    def forward(ctx, outputs):
        return outputs.view_as(outputs)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("cudnn RNN backward can only be called in training mode")


def gapped_layout(input_size, hidden_size):
    sizes = (4 * hidden_size * input_size, 4 * hidden_size * hidden_size, 4 * hidden_size,
             4 * hidden_size)
    starts, end = [], 0
    for size in sizes:
        starts.append(end + GAP)
        end += GAP + size
    return tuple(starts), end + GAP


@pytest.fixture
def cudnn(monkeypatch):
    """``torch.lstm`` as cuDNN runs it, and cuDNN's flattening of weights (with gaps), on a
    CPU; the calls' ``train`` flags and warnings are recorded."""
    calls, real_lstm = [], torch.lstm

    def flatten(weights, stride, input_size, mode, hidden_size, proj, layers, first, bi):
        starts, length = gapped_layout(input_size, hidden_size)
        buffer = torch.zeros(length, dtype=weights[0].dtype)
        for start, weight in zip(starts, weights, strict=True):
            weight.set_(buffer.untyped_storage(), start, weight.shape)
        return buffer

    def lstm(inputs, hx, params, has_biases, layers, dropout, train, bidirectional, first):
        starts, length = gapped_layout(inputs.shape[-1], hx[0].shape[-1])
        storage = params[0].untyped_storage()
        in_place = (
            params[0].storage_offset() == starts[0]
            and storage.nbytes() >= length * params[0].element_size()
            and all(p.untyped_storage().data_ptr() == storage.data_ptr() for p in params)
            and [p.storage_offset() for p in params] == list(starts)
            and all(p.is_contiguous() for p in params)
        )
        if not in_place:
            warnings.warn(COPY_WARNING, UserWarning, stacklevel=2)
        calls.append(train)
        outputs, h, c = real_lstm(inputs, hx, params, has_biases, layers, dropout, train,
                                  bidirectional, first)
        return (outputs if train else _RefuseBackward.apply(outputs)), h, c

    monkeypatch.setattr(rnn, "runs_cudnn", lambda like: True)
    monkeypatch.setattr(torch, "_cudnn_rnn_flatten_weight", flatten)
    monkeypatch.setattr("torch.backends.cudnn.rnn.get_cudnn_mode", lambda mode: 2)
    monkeypatch.setattr(torch, "lstm", lstm)
    rnn._cudnn_layout.cache_clear()
    yield calls
    rnn._cudnn_layout.cache_clear()


def inputs_for(task, n, batch=4, seed=0):
    return torch.from_numpy(task.sample(n, batch, np.random.default_rng(seed)).inputs.copy())


def fused_and_looped(hidden_size=8):
    task = get_task("reverse_string")
    torch.manual_seed(0)
    fused = build_recurrent("lstm", task, hidden_size=hidden_size)
    looped = build_recurrent("lstm", task, hidden_size=hidden_size, fused=False)
    looped.load_state_dict(fused.state_dict())
    return task, fused, looped


def test_the_fused_lstm_trains_under_cudnns_constraints(cudnn, monkeypatch):
    """Item 1: with the GPU's path forced, the fused call runs in training mode while
    gradients flow (cuDNN's backward would refuse it otherwise), in inference mode without
    them, and its gradients are the batched loop's; item 4: its weights reach the kernel
    in place (no per-call copy, no warning)."""
    monkeypatch.setattr(base, "FUSED_TRAINING_DEVICES", ("cpu",))
    task, fused, looped = fused_and_looped()
    inputs = inputs_for(task, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for model in (fused, looped):
            model(inputs).square().sum().backward()
        with torch.no_grad():
            fused(inputs)
        with torch.inference_mode():
            fused(inputs)
    assert cudnn == [True, False, False]
    for (name, a), b in zip(fused.named_parameters(), looped.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_self_tests_cpu_copy_takes_the_gpus_path(cudnn):
    """The per-model switch the self-test uses: the CPU copy trains through the fused call."""
    task, fused, _ = fused_and_looped()
    fused(inputs_for(task, 6)).sum().backward()
    assert cudnn == []  # a CPU trains with the batched loop
    fused.fused_training = True
    fused(inputs_for(task, 6)).sum().backward()
    assert cudnn == [True]


def test_weights_sit_where_cudnns_layout_puts_them():
    """The buffer's layout: each weight a view at its offset, zeros in the gaps, gradients
    back to the weights."""
    weights = [torch.randn(4, 3, requires_grad=True), torch.randn(4, requires_grad=True)]
    views = rnn.flat_lstm_weights(weights, ((20, 2), 34))
    assert [view.storage_offset() for view in views] == [20, 2]
    assert views[0].untyped_storage().data_ptr() == views[1].untyped_storage().data_ptr()
    buffer = torch.empty(0).set_(views[0].untyped_storage())
    assert buffer.numel() == 34
    assert torch.equal(buffer[20:32], weights[0].detach().flatten())
    assert not buffer[:2].any() and not buffer[6:20].any() and not buffer[32:].any()
    sum(view.sum() for view in views).backward()
    assert all(torch.equal(weight.grad, torch.ones_like(weight)) for weight in weights)
    with pytest.raises(ValueError, match="overlapping"):
        rnn.flat_lstm_weights(weights, ((0, 4), 16))
    with pytest.raises(ValueError, match="shorter"):
        rnn.flat_lstm_weights(weights, ((0, 12), 14))


def test_off_cudnn_the_weights_lie_back_to_back():
    _, fused, _ = fused_and_looped(hidden_size=4)
    starts, length = rnn.lstm_weight_layout(fused.cell.tokens, 4, torch.zeros(1))
    assert starts == (0, 16 * 3, 16 * 3 + 16 * 4, 16 * 3 + 16 * 4 + 16)
    assert length == starts[-1] + 16
