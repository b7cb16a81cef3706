"""The recurrent baselines' shared frame: CHE's input layout, the unrolled loop, the read-out
and the calls che-bench's training and evaluation make on a model.

A model is a *cell* (the inner ``hk.VanillaRNN`` or ``hk.LSTM``, over members), optionally a
*memory* (stack or tape) the cell reads before and writes after each step, and a linear
read-out of ``relu(h)``. Every parameter has a leading member axis ``[M, ...]``
(``che_bench.members``) and every step is one batched product over ``[M, B, .]``.

The cell's contract (``che_bench.model.recurrent.rnn``): ``weights()`` gives ``(table, recurrent)``,
the per-token rows of its input projection ``[M, V, G]`` (biases folded in) and the weight of
what it is fed back ``[M, E + H, G]`` (E: the memory's read width); ``initial_state``,
``hidden(state)`` and ``update(pre_activation, state) -> (h, state)`` do the rest.
The memory's (``stack_rnn``, ``tape_rnn``): ``width``, ``plan(input_tokens)`` (what a forward
pass computes once), ``initial(members, batch, like)``, ``read(memory)`` and
``write(memory, h, plan)``.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, cast

import torch

from che_bench.members import MemberLinear
from che_bench.model.base import BenchModel, output_positions
from che_bench.tasks.base import Task

FLOAT_BYTES = 4
#: Devices on which a one-member fused cell trains with torch's kernel too (cuDNN's on a GPU,
#: against ~10 kernel launches per time step unfused). On a CPU its training step measured
#: slower than the batched loop (docs/baselines.md), so there it serves evaluation only.
FUSED_TRAINING_DEVICES = ("cuda",)
#: The option of CHE's computation tokens (CHE's ``computation_steps_mult``).
COMPUTATION_STEPS = "computation_steps_mult"


class Cell(Protocol):
    """The cell's contract (see the module docstring)."""

    hidden_size: int
    gate_size: int

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def initial_state(self, members: int, batch: int, like: torch.Tensor) -> Any: ...

    def hidden(self, state: Any) -> torch.Tensor: ...

    def update(self, pre: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]: ...


class FusedCell(Cell, Protocol):
    """A cell torch has a fused kernel for (the lstm's)."""

    def fused_unroll(self, tokens: torch.Tensor) -> torch.Tensor: ...


class Memory(Protocol):
    """The memory's contract (see the module docstring)."""

    width: int

    def state_floats(self) -> int: ...

    def plan(self, input_tokens: int) -> Any: ...

    # The memory's state: a tensor (stack, tape) or a tuple of them (ndstack_rnn).
    def initial(self, members: int, batch: int, like: torch.Tensor) -> Any: ...

    def read(self, memory: Any) -> torch.Tensor: ...

    def write(self, memory: Any, h: torch.Tensor, plan: Any) -> Any: ...


def unroll(
    cell: Cell, memory: Memory | None, tokens: torch.Tensor, input_tokens: int, read: int
) -> torch.Tensor:
    """The cell's outputs ``h`` at the last ``read`` steps, ``[M, B, read, H]``, for token ids
    ``tokens [M, B, T]``: per step one row lookup and one batched product over members."""
    members, batch, steps = tokens.shape
    table, recurrent = cell.weights()
    member_rows = torch.arange(members, device=tokens.device)[:, None]
    state = cell.initial_state(members, batch, table)
    plan = memory.plan(input_tokens) if memory is not None else None
    stored = memory.initial(members, batch, table) if memory is not None else table.new_zeros(0)
    outputs = []
    for step in range(steps):
        fed_back = cell.hidden(state)
        if memory is not None:
            fed_back = torch.cat([memory.read(stored), fed_back], dim=-1)
        pre = torch.baddbmm(table[member_rows, tokens[:, :, step]], fed_back, recurrent)
        h, state = cell.update(pre, state)
        if memory is not None:
            stored = memory.write(stored, h, plan)
        if step >= steps - read:
            outputs.append(h)
    if not outputs:
        return table.new_zeros(members, batch, 0, cell.hidden_size)
    return torch.stack(outputs, dim=2)


class RecurrentModel(BenchModel):
    """One of CHE's recurrent baselines for one task, ``members`` models side by side;
    ``forward(inputs)`` returns the logits ``[M, B, output_length(n), output_size]`` (at the
    appended empty positions, or at the inputs for an in-place task), as ``Encoder`` does.

    ``fused``: a one-member model runs its cell's ``fused_unroll`` (torch's kernel) when not
    computing gradients, and when training on a ``FUSED_TRAINING_DEVICES`` device (the
    builder sets it for the lstm only); ``fused_training`` True makes it train so on any
    device (the self-test's CPU copy takes the GPU's path with it).

    ``computation_steps``: CHE's ``computation_steps_mult``; when positive, that many times
    ``n`` computation tokens (id ``input_size``) follow the ``n`` input tokens, then the empty
    output tokens (id ``input_size + 1``), whose outputs are read.
    """

    #: None: train with the fused kernel on ``FUSED_TRAINING_DEVICES``; True: everywhere.
    fused_training: bool | None = None

    #: ``fused`` picks a kernel for the same function (outputs equal up to rounding).
    inert_options = frozenset({"memory_budget_bytes", "fused"})

    def __init__(
        self,
        task: Task,
        cell: Cell,
        memory: Memory | None,
        *,
        architecture: str,
        members: int,
        memory_budget_bytes: int,
        fused: bool,
        computation_steps: int = 0,
        sizes: dict[str, Any],
        build_options: dict[str, Any],
    ) -> None:
        super().__init__()
        self.task, self.cell, self.memory = task, cell, memory
        self.architecture, self.members, self.fused = architecture, members, fused
        self.memory_budget_bytes = memory_budget_bytes
        self.computation_steps = computation_steps
        # Read left to right (with computation tokens an in-place task is refused), unless
        # the memory is told the input's length (the tape's jumps).
        self.causal_outputs = getattr(memory, "causal", True)
        self._sizes = sizes
        #: What the builder was given besides task and members (to build a pack alike).
        self.build_options = build_options
        # CHE models/rnn.py make_rnn: output = hk.Linear(output_size)(relu(core output)).
        self.head = MemberLinear(members, cell.hidden_size, task.output_size)

    # -- memory budget ----------------------------------------------------------------------

    def query_row_bytes(self, input_tokens: int, device: torch.device | None = None) -> int:
        """Bytes one sequence (every member) holds during a forward pass without gradients:
        its read-out outputs, recurrent state, memory and gate pre-activations. The least
        memory a forward pass can be split down to."""
        read = output_positions(self.task, input_tokens)[1]
        hidden = self.cell.hidden_size
        memory = self.memory.state_floats() if self.memory is not None else 0
        per_sequence = (read + 2) * hidden + self.cell.gate_size + memory
        return FLOAT_BYTES * self.members * per_sequence

    # -- forward ----------------------------------------------------------------------------

    def with_output_tokens(self, inputs: torch.Tensor) -> tuple[torch.Tensor, int]:
        """CHE's layout (``BenchModel.with_output_tokens``), with ``computation_steps * n``
        computation tokens before the empty output tokens when ``computation_steps`` > 0
        (CHE experiments/utils.py make_model_with_empty_targets)."""
        if not self.computation_steps:
            return super().with_output_tokens(inputs)
        placeholders, read = output_positions(self.task, inputs.shape[-1])
        empty = self.task.input_size
        parts = [
            inputs,
            inputs.new_full((*inputs.shape[:2], self.computation_steps * inputs.shape[-1]), empty),
            inputs.new_full((*inputs.shape[:2], placeholders), empty + 1),
        ]
        return torch.cat(parts, dim=-1), read

    def forward(
        self,
        inputs: torch.Tensor,
        draws: Any = None,
        *,
        evaluating: bool | None = None,
        dropout_seeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[M, B, output_length(n), output_size]`` for int64 ``inputs`` ``[B, n]``
        (the same sequences for every member) or ``[M, B, n]`` (each member its own).
        ``draws``, ``evaluating`` and ``dropout_seeds`` are accepted for ``Encoder``'s
        signature and unused."""
        inputs = self.member_inputs(inputs)
        input_tokens = inputs.shape[-1]
        tokens, read = self.with_output_tokens(inputs)
        hidden = self.in_sub_batches(
            lambda part: self._hidden_outputs(part, input_tokens, read), tokens, input_tokens
        )
        return self.head(torch.relu(hidden))

    def _hidden_outputs(self, tokens: torch.Tensor, input_tokens: int, read: int) -> torch.Tensor:
        if (
            self.fused
            and self.members == 1
            and (
                not torch.is_grad_enabled()
                or self.fused_training
                or tokens.device.type in FUSED_TRAINING_DEVICES
            )
        ):
            outputs = cast(FusedCell, self.cell).fused_unroll(tokens[0])
            return outputs[None, :, outputs.shape[1] - read :]
        return unroll(self.cell, self.memory, tokens, input_tokens, read)

    # -- inspection -------------------------------------------------------------------------

    def with_members(self, members: int) -> RecurrentModel:
        from che_bench.model.recurrent import build_recurrent

        return build_recurrent(self.architecture, self.task, members=members, **self.build_options)

    def build_key(self) -> str:
        return json.dumps([super().build_key(), self.architecture], sort_keys=True, default=repr)

    def describe(self) -> dict[str, Any]:
        """The fully resolved configuration of one member, for recording with results."""
        return {
            "architecture": self.architecture,
            "task": self.task.name,
            "task_params": self.task.params(),
            **self._sizes,
            "fused": self.fused,
            "memory_budget_bytes": self.memory_budget_bytes,
            "parameters": sum(p.numel() for p in self.parameters()) // self.members,
        }
