"""CHE's ``tape_rnn`` memory: the tape of CHE models/tape_rnn.py ``TapeInputLengthJumpCore``
(one tape; CHE's ``n_tapes`` default is 1).

The tape is a ring of ``size`` cells; the head is always at index 0 (moving the head rolls
the tape). Each step the cell reads the head's cell (concatenated after its one-hot input);
from its output ``h`` an MLP (ReLU between layers, none after the last) gives the value
written at the head, and a linear map plus softmax the probabilities of five moves after
the write. With ``written`` = the tape whose head cell holds that value,

    new = sum_a p_a * roll(written, shift_a)    roll(x, s)[i] = x[(i - s) mod size]

with shifts (0, -1, +1, -n, +n) for the actions (stay, left, right, jump left, jump right)
in CHE's order, ``n`` being the number of input tokens (CHE passes the input length, without
the appended empty positions). The tape starts as zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import cast

import torch
from torch import nn

from che_bench.members import MemberLinear

ACTIONS = 5


def jump_indices(size: int, input_tokens: int, device: torch.device | None = None) -> torch.Tensor:
    """``[5, size]``: row a lists, for each cell of the new tape, the cell of the written tape
    it comes from under action a (CHE's ``_tape_operations`` as gathers)."""
    shifts = torch.tensor([0, -1, 1, -input_tokens, input_tokens], device=device)
    cells = torch.arange(size, device=device)
    return (cells[None, :] - shifts[:, None]) % size


def update_tape(
    tape: torch.Tensor, actions: torch.Tensor, write_value: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """The blended tape ``[M, B, size, cell]`` after writing ``write_value [M, B, cell]`` at the
    head and moving with probabilities ``actions [M, B, 5]`` (``indices``: ``jump_indices``)."""
    written = torch.cat([write_value.unsqueeze(2), tape[:, :, 1:]], dim=2)
    moved = written[:, :, indices]  # [M, B, 5, size, cell]
    return torch.einsum("mba,mbasc->mbsc", actions, moved)


class TapeMemory(nn.Module):
    """One tape of ``size`` cells of ``cell_size`` floats per sequence and member, driven by
    the cell's output (``hidden_size``) through a write MLP of ``mlp_layers`` hidden sizes."""

    def __init__(
        self, members: int, hidden_size: int, cell_size: int, size: int, mlp_layers: Sequence[int]
    ) -> None:
        super().__init__()
        self.cell_size, self.size, self.width = cell_size, size, cell_size
        # CHE models/tape_rnn.py TapeRNNCore.__call__: hk.nets.MLP(mlp_layers + [cell]) and
        # hk.Linear(num_actions), both of h.
        sizes = [hidden_size, *mlp_layers, cell_size]
        self.write_mlp = nn.ModuleList(
            MemberLinear(members, fan_in, fan_out) for fan_in, fan_out in pairwise(sizes)
        )
        self.actions = MemberLinear(members, hidden_size, ACTIONS)

    def state_floats(self) -> int:
        return self.size * self.cell_size

    def plan(self, input_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The two maps of ``h`` as one (weight ``[M, H, first + 5]``, bias ``[M, 1, .]``) and
        the moves' gathers at this input length."""
        first = cast(MemberLinear, self.write_mlp[0])
        weight = torch.cat([first.weight, self.actions.weight], dim=1).transpose(1, 2)
        bias = torch.cat([first.bias_parameter(), self.actions.bias_parameter()], dim=1)[:, None]
        return weight, bias, jump_indices(self.size, input_tokens, weight.device)

    def initial(self, members: int, batch: int, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(members, batch, self.size, self.cell_size)

    def read(self, tape: torch.Tensor) -> torch.Tensor:
        return tape[:, :, 0]

    def write(
        self, tape: torch.Tensor, h: torch.Tensor, plan: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        weight, bias, indices = plan
        first, logits = torch.baddbmm(bias, h, weight).split(
            [self.write_mlp[0].fan_out, ACTIONS], dim=-1
        )
        value = first
        for layer in self.write_mlp[1:]:
            value = layer(torch.relu(value))
        return update_tape(tape, torch.softmax(logits, dim=-1), value, indices)
