"""CHE's ``tape_rnn`` memory: the tapes of CHE models/tape_rnn.py ``TapeInputLengthJumpCore``
(``n_tapes`` of them; CHE's default is 1).

A tape is a ring of ``size`` cells; the head is always at index 0 (moving the head rolls
the tape). Each step the cell reads the head's cell of every tape (concatenated, tape after
tape, after its one-hot input); from its output ``h`` an MLP (ReLU between layers, none
after the last) gives the ``n_tapes * cell`` values written at the heads, and one linear map
plus softmax per tape the probabilities of five moves after the write. With ``written`` =
a tape whose head cell holds its value,

    new = sum_a p_a * roll(written, shift_a)    roll(x, s)[i] = x[(i - s) mod size]

with shifts (0, -1, +1, -n, +n) for the actions (stay, left, right, jump left, jump right)
in CHE's order, ``n`` being the number of input tokens (CHE passes the input length, without
the appended computation or empty positions). The tapes start as zeros and move apart (each
its own action probabilities, the same shifts), so they are held as ``n_tapes`` rows per
sequence: ``[M, B * n_tapes, size, cell]``, row ``b * n_tapes + t`` being tape t of
sequence b.
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
    """``tapes`` tapes of ``size`` cells of ``cell_size`` floats per sequence and member,
    driven by the cell's output (``hidden_size``) through a write MLP of ``mlp_layers``
    hidden sizes."""

    #: Its jumps move by the input's length: an output depends on how long the input is.
    causal = False

    def __init__(
        self,
        members: int,
        hidden_size: int,
        cell_size: int,
        size: int,
        mlp_layers: Sequence[int],
        tapes: int = 1,
    ) -> None:
        super().__init__()
        self.cell_size, self.size, self.tapes = cell_size, size, tapes
        self.width = tapes * cell_size
        # CHE models/tape_rnn.py TapeRNNCore.__call__: hk.nets.MLP(mlp_layers + [n_tapes *
        # cell]) and one hk.Linear(num_actions) per tape, all of h (here the tapes' action
        # maps side by side in one, tape t's the columns 5t..5t+4).
        sizes = [hidden_size, *mlp_layers, tapes * cell_size]
        self.write_mlp = nn.ModuleList(
            MemberLinear(members, fan_in, fan_out) for fan_in, fan_out in pairwise(sizes)
        )
        self.actions = MemberLinear(members, hidden_size, tapes * ACTIONS)

    def state_floats(self) -> int:
        return self.tapes * self.size * self.cell_size

    def plan(self, input_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The two maps of ``h`` as one (weight ``[M, H, first + 5]``, bias ``[M, 1, .]``) and
        the moves' gathers at this input length."""
        first = cast(MemberLinear, self.write_mlp[0])
        weight = torch.cat([first.weight, self.actions.weight], dim=1).transpose(1, 2)
        bias = torch.cat([first.bias_parameter(), self.actions.bias_parameter()], dim=1)[:, None]
        return weight, bias, jump_indices(self.size, input_tokens, weight.device)

    def initial(self, members: int, batch: int, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(members, batch * self.tapes, self.size, self.cell_size)

    def read(self, tape: torch.Tensor) -> torch.Tensor:
        """The heads' cells ``[M, B, tapes * cell]``, tape after tape (CHE's reshape)."""
        heads = tape[:, :, 0]
        return heads.reshape(heads.shape[0], -1, self.width)

    def write(
        self, tape: torch.Tensor, h: torch.Tensor, plan: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        weight, bias, indices = plan
        first, logits = torch.baddbmm(bias, h, weight).split(
            [self.write_mlp[0].fan_out, self.tapes * ACTIONS], dim=-1
        )
        value = first
        for layer in self.write_mlp[1:]:
            value = layer(torch.relu(value))
        # One row per tape (no-op reshapes for one tape); each tape its own softmax.
        members = tape.shape[0]
        actions = torch.softmax(logits.reshape(members, -1, ACTIONS), dim=-1)
        return update_tape(tape, actions, value.reshape(members, -1, self.cell_size), indices)
