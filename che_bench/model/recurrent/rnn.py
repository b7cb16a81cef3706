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
to float rounding; 25% faster at T = 500 on a CPU thread). Its training step, and the rnn's
``torch.rnn_relu`` both ways, measured slower than the batched loop, so they are not used.
"""

from __future__ import annotations

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
        params = [
            weight[:, : self.tokens],
            weight[:, self.tokens :],
            self.gates.bias_parameter()[0, self.to_torch_order],
            self.forget_offset[self.to_torch_order],
        ]
        h0 = one_hot.new_zeros(1, tokens.shape[0], self.hidden_size)
        outputs, _, _ = torch.lstm(one_hot, (h0, h0), params, True, 1, 0.0, False, False, True)
        return outputs


CELLS: dict[str, type[VanillaCell] | type[LSTMCell]] = {"rnn": VanillaCell, "lstm": LSTMCell}
