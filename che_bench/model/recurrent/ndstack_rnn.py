"""CHE's ``ndstack_rnn`` memory: the differentiable nondeterministic stack of DuSell & Chiang
(2020, arXiv 2010.04674) as CHE models/ndstack_rnn.py ``NDStackRNNCore`` builds it, over a
vanilla RNN (CHE experiments/constants.py MODEL_BUILDERS['ndstack_rnn']).

The stack simulates a pushdown automaton with ``Q`` states and ``S`` stack symbols over all
its runs at once (Lang's algorithm). Its state is the tensor ``gamma[i -> t][q, x -> r, y]``
(the weight of a stack segment from node (i, q, x) to node (t, r, y)) and ``alpha[t][r, y]``
(the weight of reaching node (t, r, y)). Each step t = 1, 2, ... the cell's output ``h`` gives,
through one linear map and one softmax over all of them, the weights of the pushes
``push[q, x -> r, y]``, pops ``pop[q, x -> r]`` and replacements ``repl[q, x -> r, y]``, and
column t of gamma is

    gamma[i -> t] = [i = t-1] push + gamma[i -> t-1] repl
                    + sum_{i < k < t-1} sum_u gamma[i -> k][q, x -> u, y]
                                              (gamma[k -> t-1] pop)[u, y -> r]
    alpha[t] = sum_{i < t} alpha[i] gamma[i -> t]

The cell reads ``alpha[t]`` summed over states (``S`` floats; ``Q * S`` with ``read_states``)
divided by its sum + 0.001, and starts from a zero read, gamma = 0 and alpha[0] = 1 at
(q, x) = (0, 0).

CHE keeps gamma in a ``stack_size`` x ``stack_size`` array (30 x 30 by default) and indexes it
with the step: from step ``stack_size`` on, its scatters (the new column, the new alpha) fall
outside the array, which JAX drops, and its gathers of column t clamp to the last column, so
the stack stops changing and the read stays the one of step ``stack_size - 1``. The fast form
here computes exactly that without the dropped work: steps past the array return the state
unchanged (tests/ndstack_oracle.py replays CHE's clamped gathers and dropped scatters).

The last column is kept as it is (column t holds the sources 0..t-1) and, for the pops, the
earlier columns in one zero-padded block laid out for a batched product, so a step is a few
batched products over members and sequences.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.members import MemberLinear

# CHE models/ndstack_rnn.py _EPSILON: added to the read's sum before dividing by it.
READ_EPSILON = 0.001


class NDStackState(NamedTuple):
    """The stack after ``steps`` steps. ``last``: gamma's column ``steps``, ``[M, B, steps, QS,
    QS]`` (sources i < steps; (q, x) pairs flattened as q * S + x). ``earlier``: columns k <
    steps, zero-padded to ``[M, B, S, i, QS, k, Q]`` (``earlier[.., y, i, (q, x), k, u]`` =
    gamma[i -> k][q, x -> u, y]: the pops' product reads it as it is). ``alpha``: ``[M, B,
    steps + 1, QS]``. ``read``: the cell's next read, ``[M, B, width]``."""

    steps: int
    last: torch.Tensor
    earlier: torch.Tensor
    alpha: torch.Tensor
    read: torch.Tensor


def action_sizes(states: int, symbols: int) -> tuple[int, int, int]:
    """How many of the softmax's outputs are pushes, pops and replacements, in CHE's order."""
    pairs = states * symbols
    return pairs * pairs, pairs * states, pairs * pairs


def split_actions(
    actions: torch.Tensor, states: int, symbols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``actions [..., A]`` (softmax outputs) as push ``[..., QS, QS]``, pop ``[..., QS, Q]``
    and replace ``[..., QS, QS]`` (CHE reshapes them to (Q, S, Q, S), (Q, S, Q), (Q, S, Q, S))."""
    pairs = states * symbols
    push, pop, replace = actions.split(action_sizes(states, symbols), dim=-1)
    lead = actions.shape[:-1]
    return (
        push.reshape(*lead, pairs, pairs),
        pop.reshape(*lead, pairs, states),
        replace.reshape(*lead, pairs, pairs),
    )


def normalised_read(alpha_t: torch.Tensor, states: int, read_states: bool) -> torch.Tensor:
    """The cell's read of ``alpha_t [M, B, QS]``: over symbols (states summed) or over
    (state, symbol) pairs, divided by its sum + READ_EPSILON."""
    read = alpha_t if read_states else alpha_t.unflatten(-1, (states, -1)).sum(dim=-2)
    return read / (read.sum(dim=-1, keepdim=True) + READ_EPSILON)


def initial_state(
    members: int, batch: int, states: int, symbols: int, width: int, like: torch.Tensor
) -> NDStackState:
    """No column yet, alpha[0] = 1 at (q, x) = (0, 0), a zero read."""
    pairs = states * symbols
    alpha = like.new_zeros(members, batch, 1, pairs)
    alpha[:, :, 0, 0] = 1.0
    return NDStackState(
        0,
        like.new_zeros(members, batch, 0, pairs, pairs),
        like.new_zeros(members, batch, symbols, 0, pairs, 0, states),
        alpha,
        like.new_zeros(members, batch, width),
    )


def next_column(
    state: NDStackState, push: torch.Tensor, pop: torch.Tensor, replace: torch.Tensor
) -> torch.Tensor:
    """gamma's column t = state.steps + 1 (``[M, B, t, QS, QS]``) after push ``[M, B, QS, QS]``,
    pop ``[M, B, QS, Q]`` and replace ``[M, B, QS, QS]``."""
    members, batch, sources, pairs, _ = state.last.shape  # column t-1, sources i < t-1
    states = pop.shape[-1]
    symbols = pairs // states
    rows = state.last.flatten(2, 3)  # [M, B, (i, (q, x)), (s, z)]
    replaced = torch.matmul(rows, replace).view(members, batch, sources, pairs, pairs)
    # pop_from[.., y, (k, u), r] = (gamma[k -> t-1] pop)[u, y -> r], k < t-1.
    pop_from = torch.matmul(rows, pop).view(members, batch, sources, states, symbols, states)
    pop_from = pop_from.permute(0, 1, 4, 2, 3, 5).reshape(
        members, batch, symbols, sources * states, states
    )
    # earlier covers the same k < t-1 and i < t-1: sum over k and u for each y.
    popped = torch.matmul(state.earlier.flatten(5, 6).flatten(3, 4), pop_from)
    popped = popped.view(members, batch, symbols, sources, pairs, states)
    popped = popped.permute(0, 1, 3, 4, 5, 2).reshape(members, batch, sources, pairs, pairs)
    return torch.cat([replaced + popped, push[:, :, None]], dim=2)


def with_column(earlier: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """``earlier`` (columns k < t-1) with column t-1 ``[M, B, t-1, QS, QS]`` added, sources
    padded to t."""
    members, batch, sources, pairs, _ = column.shape
    states = earlier.shape[-1]
    grown = F.pad(earlier, (0, 0, 0, 1, 0, 0, 0, 1))  # one more source i and column k
    # [M, B, i, (q, x), (u, y)] -> [M, B, y, i, (q, x), u]
    laid_out = column.view(members, batch, sources, pairs, states, pairs // states).permute(
        0, 1, 5, 2, 3, 4
    )
    grown[:, :, :, :sources, :, sources, :] = laid_out
    return grown


def advance(
    state: NDStackState,
    push: torch.Tensor,
    pop: torch.Tensor,
    replace: torch.Tensor,
    read_states: bool,
) -> NDStackState:
    """The stack one step on: its new column, alpha and read (no bound on the steps: the
    caller stops at the array's size)."""
    column = next_column(state, push, pop, replace)
    # alpha[t] = sum over i < t and (q, x) of alpha[i][q, x] gamma[i -> t][q, x -> r, y].
    alpha_t = torch.matmul(state.alpha.flatten(2)[:, :, None], column.flatten(2, 3))[:, :, 0]
    return NDStackState(
        state.steps + 1,
        column,
        with_column(state.earlier, state.last),
        torch.cat([state.alpha, alpha_t[:, :, None]], dim=2),
        normalised_read(alpha_t, pop.shape[-1], read_states),
    )


class NDStackMemory(nn.Module):
    """The nondeterministic stack of ``states`` states and ``symbols`` symbols in a
    ``size`` x ``size`` array, per sequence and member, driven by the cell's output
    (``hidden_size``); ``width`` floats read (``symbols``, or ``states * symbols`` with
    ``read_states``)."""

    def __init__(
        self,
        members: int,
        hidden_size: int,
        states: int,
        symbols: int,
        size: int,
        read_states: bool,
    ) -> None:
        super().__init__()
        self.states, self.symbols, self.size, self.read_states = states, symbols, size, read_states
        self.width = states * symbols if read_states else symbols
        # CHE models/ndstack_rnn.py NDStackRNNCore.__call__: hk.Linear(push + pop + replace)
        # of the core's output, one softmax over all of them.
        self.actions = MemberLinear(members, hidden_size, sum(action_sizes(states, symbols)))

    def state_floats(self) -> int:
        pairs = self.states * self.symbols
        # gamma's columns twice (the last one and the padded block) and alpha.
        return 2 * self.size * self.size * pairs * pairs + self.size * pairs + self.width

    def plan(self, input_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The actions' map of ``h`` (weight ``[M, H, A]``, bias ``[M, 1, A]``)."""
        return self.actions.weight.transpose(1, 2), self.actions.bias_parameter()[:, None]

    def initial(self, members: int, batch: int, like: torch.Tensor) -> NDStackState:
        return initial_state(members, batch, self.states, self.symbols, self.width, like)

    def read(self, state: NDStackState) -> torch.Tensor:
        return state.read

    def write(
        self, state: NDStackState, h: torch.Tensor, plan: tuple[torch.Tensor, torch.Tensor]
    ) -> NDStackState:
        if self.frozen(state):
            return state  # (the actions would go unused: not computed)
        weight, bias = plan
        return self.step(state, torch.softmax(torch.baddbmm(bias, h, weight), dim=-1))

    def frozen(self, state: NDStackState) -> bool:
        """Whether the next step's column lies past the array: CHE's writes there are dropped
        and its reads clamp to the last column, so the stack and its read no longer change
        (module docstring)."""
        return state.steps + 1 >= self.size

    def step(self, state: NDStackState, actions: torch.Tensor) -> NDStackState:
        """The stack after one step with ``actions [M, B, A]`` (the softmax's outputs)."""
        if self.frozen(state):
            return state
        push, pop, replace = split_actions(actions, self.states, self.symbols)
        return advance(state, push, pop, replace, self.read_states)
