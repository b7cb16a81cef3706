"""CHE's ``stack_rnn`` and ``stack_lstm`` memory: the differentiable stack of Joulin & Mikolov
(2015) as CHE models/stack_rnn.py builds it (one stack; CHE's ``n_stacks`` default is 1).

Each step the cell reads the stack's top cell (concatenated after its one-hot input), and
from its output ``h`` two linear maps give the value to push and, through a softmax, the
probabilities of the three actions (push, pop, no-op) that blend the shifted stacks:

    new[0] = p_push * push_value + p_pop * old[1]   + p_noop * old[0]
    new[i] = p_push * old[i - 1] + p_pop * old[i+1] + p_noop * old[i]   (old[size] = 0)

The stack starts empty (zeros).
"""

from __future__ import annotations

import torch
from torch import nn

from che_bench.members import MemberLinear

# CHE models/stack_rnn.py: _NUM_ACTIONS = 3, softmax over (push, pop, no-op) in that order.
PUSH, POP, NO_OP = range(3)
ACTIONS = 3


def update_stack(
    stack: torch.Tensor, actions: torch.Tensor, push_value: torch.Tensor
) -> torch.Tensor:
    """The blended stack ``[..., size, cell]`` after ``actions [..., 3]`` (probabilities of
    push, pop, no-op) with ``push_value [..., cell]``; index 0 is the top."""
    pushed = torch.cat([push_value.unsqueeze(-2), stack[..., :-1, :]], dim=-2)
    popped = torch.cat([stack[..., 1:, :], torch.zeros_like(stack[..., :1, :])], dim=-2)
    weights = actions.unsqueeze(-1).unsqueeze(-1)
    return (
        weights[..., PUSH, :, :] * pushed
        + weights[..., POP, :, :] * popped
        + weights[..., NO_OP, :, :] * stack
    )


class StackMemory(nn.Module):
    """One stack of ``size`` cells of ``cell_size`` floats per sequence and member, driven
    by the cell's output (``hidden_size``)."""

    def __init__(self, members: int, hidden_size: int, cell_size: int, size: int) -> None:
        super().__init__()
        self.cell_size, self.size, self.width = cell_size, size, cell_size
        # CHE models/stack_rnn.py StackRNNCore.__call__: hk.Linear(cell) and hk.Linear(3) of h.
        self.push_value = MemberLinear(members, hidden_size, cell_size)
        self.actions = MemberLinear(members, hidden_size, ACTIONS)

    def state_floats(self) -> int:
        return self.size * self.cell_size

    def plan(self, input_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Both read-outs of ``h`` as one map: (weight ``[M, H, cell + 3]``, bias ``[M, 1, .]``)."""
        weight = torch.cat([self.push_value.weight, self.actions.weight], dim=1).transpose(1, 2)
        bias = torch.cat([self.push_value.bias_parameter(), self.actions.bias_parameter()], dim=1)[
            :, None
        ]
        return weight, bias

    def initial(self, members: int, batch: int, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(members, batch, self.size, self.cell_size)

    def read(self, stack: torch.Tensor) -> torch.Tensor:
        return stack[:, :, 0]

    def write(
        self, stack: torch.Tensor, h: torch.Tensor, plan: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        weight, bias = plan
        out = torch.baddbmm(bias, h, weight)
        push_value, logits = out.split([self.cell_size, ACTIONS], dim=-1)
        return update_stack(stack, torch.softmax(logits, dim=-1), push_value)
