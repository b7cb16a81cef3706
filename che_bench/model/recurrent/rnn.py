"""CHE's ``rnn`` and ``lstm`` baselines (CHE experiments/constants.py MODEL_BUILDERS:
``make_rnn`` with ``hk.VanillaRNN`` / ``hk.LSTM``), and those two cells over members, which
the stack and tape models use as their inner core.

Both cells follow Haiku exactly (dm-haiku haiku/_src/recurrent.py), with hk.Linear's
initialisation (truncated normal, std 1/sqrt(fan_in), cut at 2 std; zero bias) and zero
initial states:

* ``VanillaCell`` = hk.VanillaRNN: ``h' = relu(W_i x + b_i + W_h h + b_h)``, two linear maps
  each with its bias (``double_bias=True``, Haiku's default).
* ``LSTMCell`` = hk.LSTM: one linear map of ``[x, h]`` (so fan_in = |x| + H for every gate)
  into gates in Haiku's order (i, g, f, o); the forget gate is ``sigmoid(f + 1)``, the +1
  added in the computation (not to the stored bias).

Each cell's input projection of the one-hot tokens is a row lookup (``weights()``'s table):
one-hot times a matrix is exactly that matrix's row.

torch's fused kernels: the one-member lstm's evaluation runs ``torch.lstm`` (same outputs up
to float rounding; 25% faster at T = 500 on a CPU thread), and so does its training step on a
GPU (cuDNN's kernel; ``base.FUSED_TRAINING_DEVICES``). On a CPU its training step, and the
rnn's ``torch.rnn_relu`` both ways, measured slower than the batched loop, so they are not used.
The kernel runs in training mode whenever gradients flow through it (cuDNN's backward refuses
a forward run in inference mode) and reads its four weights from one buffer laid out as cuDNN
lays out an ``nn.LSTM``'s flattened weights, so cuDNN uses them in place (a scattered list
would be copied into such a buffer on every call, with a warning).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

from che_bench.members import MemberLinear

# dm-haiku haiku/_src/recurrent.py LSTM: f = sigmoid(f + 1), gates split as (i, g, f, o).
FORGET_BIAS = 1.0
HAIKU_GATES = "igfo"
TORCH_GATES = "ifgo"


class VanillaCell(nn.Module):
    """hk.VanillaRNN for ``members`` models: ``tokens`` one-hot classes plus ``extra`` inputs
    (a memory's read) -> ``hidden_size``."""

    def __init__(self, members: int, tokens: int, extra: int, hidden_size: int) -> None:
        super().__init__()
        self.tokens, self.hidden_size, self.gate_size = tokens, hidden_size, hidden_size
        self.input_to_hidden = MemberLinear(members, tokens + extra, hidden_size)
        self.hidden_to_hidden = MemberLinear(members, hidden_size, hidden_size)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token rows ``[M, V, H]`` with both biases, weight of ``[extra, h]`` ``[M, E+H, H]``)."""
        w_input, w_hidden = self.input_to_hidden.weight, self.hidden_to_hidden.weight
        bias = self.input_to_hidden.bias_parameter() + self.hidden_to_hidden.bias_parameter()
        table = w_input[:, :, : self.tokens].transpose(1, 2) + bias[:, None]
        recurrent = torch.cat([w_input[:, :, self.tokens :], w_hidden], dim=2).transpose(1, 2)
        return table, recurrent

    def initial_state(self, members: int, batch: int, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(members, batch, self.hidden_size)

    def hidden(self, state: torch.Tensor) -> torch.Tensor:
        return state

    def update(self, pre: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(pre)
        return h, h


class LSTMCell(nn.Module):
    """hk.LSTM for ``members`` models: ``tokens`` one-hot classes plus ``extra`` inputs ->
    ``hidden_size``; state (h, c)."""

    forget_offset: torch.Tensor
    to_torch_order: torch.Tensor

    def __init__(self, members: int, tokens: int, extra: int, hidden_size: int) -> None:
        super().__init__()
        self.tokens, self.hidden_size, self.gate_size = tokens, hidden_size, 4 * hidden_size
        # One map of [x, extra, h], as hk.LSTM concatenates [inputs, prev_state.hidden].
        self.gates = MemberLinear(members, tokens + extra + hidden_size, 4 * hidden_size)
        offset = torch.zeros(4 * hidden_size)
        forget = HAIKU_GATES.index("f")
        offset[forget * hidden_size : (forget + 1) * hidden_size] = FORGET_BIAS
        self.register_buffer("forget_offset", offset, persistent=False)
        order = [HAIKU_GATES.index(gate) for gate in TORCH_GATES]
        to_torch = torch.cat([torch.arange(g * hidden_size, (g + 1) * hidden_size) for g in order])
        self.register_buffer("to_torch_order", to_torch, persistent=False)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token rows ``[M, V, 4H]`` with bias and forget offset, weight of ``[extra, h]``
        ``[M, E+H, 4H]``)."""
        weight, bias = self.gates.weight, self.gates.bias_parameter() + self.forget_offset
        table = weight[:, :, : self.tokens].transpose(1, 2) + bias[:, None]
        return table, weight[:, :, self.tokens :].transpose(1, 2)

    def initial_state(
        self, members: int, batch: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = like.new_zeros(members, batch, self.hidden_size)
        return zeros, zeros

    def hidden(self, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return state[0]

    def update(
        self, pre: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        i, g, f, o = pre.chunk(4, dim=-1)
        c = torch.sigmoid(f) * state[1] + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, (h, c)

    def fused_unroll(self, tokens: torch.Tensor) -> torch.Tensor:
        """Outputs ``[B, T, H]`` of member 0 for ids ``[B, T]`` by torch's fused kernel (no
        extra inputs: the plain lstm); the forget offset rides in the second bias."""
        weight = self.gates.weight[0, self.to_torch_order]
        one_hot = nn.functional.one_hot(tokens, self.tokens).to(weight.dtype)
        params = flat_lstm_weights(
            [
                weight[:, : self.tokens],
                weight[:, self.tokens :],
                self.gates.bias_parameter()[0, self.to_torch_order],
                self.forget_offset[self.to_torch_order],
            ],
            lstm_weight_layout(self.tokens, self.hidden_size, weight),
        )
        # Training mode whenever gradients flow: cuDNN's backward refuses an inference-mode
        # forward ("cudnn RNN backward can only be called in training mode"); dropout is 0.
        train = params[0].requires_grad
        h0 = one_hot.new_zeros(1, tokens.shape[0], self.hidden_size)
        outputs, _, _ = torch.lstm(one_hot, (h0, h0), params, True, 1, 0.0, train, False, True)
        return outputs


#: Where the four weights of a one-layer lstm (w_ih, w_hh, b_ih, b_hh) start in one buffer,
#: and the buffer's length, in elements.
Layout = tuple[tuple[int, ...], int]


def lstm_weight_layout(input_size: int, hidden_size: int, like: torch.Tensor) -> Layout:
    """The buffer ``torch.lstm`` reads a one-layer lstm's weights from in place: cuDNN's own
    layout where cuDNN runs the call (asked of cuDNN once per shape), else the four back to
    back (torch's other kernels take any tensors)."""
    if runs_cudnn(like):
        return _cudnn_layout(input_size, hidden_size, like.device, like.dtype)
    sizes = (4 * hidden_size * input_size, 4 * hidden_size * hidden_size, 4 * hidden_size)
    starts = (0, sizes[0], sizes[0] + sizes[1], sizes[0] + sizes[1] + sizes[2])
    return starts, starts[-1] + sizes[2]


def runs_cudnn(like: torch.Tensor) -> bool:
    """Whether ``torch.lstm`` on tensors like ``like`` dispatches to cuDNN."""
    return (
        like.is_cuda
        and torch._use_cudnn_rnn_flatten_weight()
        and torch.backends.cudnn.is_acceptable(like)
    )


@functools.cache
def _cudnn_layout(
    input_size: int, hidden_size: int, device: torch.device, dtype: torch.dtype
) -> Layout:
    """cuDNN's layout, read off the buffer it flattens placeholder weights into (as
    ``nn.LSTM.flatten_parameters`` does): each weight is then a view at its offset."""
    from torch.backends.cudnn import rnn as cudnn_rnn

    gates = 4 * hidden_size
    shapes = ((gates, input_size), (gates, hidden_size), (gates,), (gates,))
    with torch.no_grad():
        weights = [torch.empty(shape, device=device, dtype=dtype) for shape in shapes]
        buffer = torch._cudnn_rnn_flatten_weight(
            weights,
            4,
            input_size,
            cudnn_rnn.get_cudnn_mode("LSTM"),
            hidden_size,
            0,  # no projection
            1,  # one layer
            True,  # batch first
            False,  # one direction
        )
    return tuple(int(weight.storage_offset()) for weight in weights), buffer.numel()


def flat_lstm_weights(weights: Sequence[torch.Tensor], layout: Layout) -> list[torch.Tensor]:
    """``weights`` copied into one new buffer laid out as ``layout`` says (zeros in any gap),
    returned as views of it; gradients flow back to ``weights``."""
    starts, length = layout
    pieces, end = [], 0
    for start, weight in sorted(zip(starts, weights, strict=True), key=lambda pair: pair[0]):
        if start < end:
            raise ValueError(f"overlapping lstm weight layout {layout}")
        if start > end:
            pieces.append(weight.new_zeros(start - end))
        pieces.append(weight.reshape(-1))
        end = start + weight.numel()
    if length < end:
        raise ValueError(f"lstm weight layout {layout} is shorter than its weights")
    if length > end:
        pieces.append(weights[0].new_zeros(length - end))
    buffer = torch.cat(pieces)
    return [
        buffer[start : start + weight.numel()].view(weight.shape)
        for start, weight in zip(starts, weights, strict=True)
    ]


CELLS: dict[str, type[VanillaCell] | type[LSTMCell]] = {"rnn": VanillaCell, "lstm": LSTMCell}
