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

from che_bench.errors import CheBenchError
from che_bench.members import MemberLinear
from che_bench.model.base import BenchModel
from che_bench.tasks.base import Task

FLOAT_BYTES = 4
#: Devices on which a one-member fused cell trains with torch's kernel too (cuDNN's on a GPU,
#: against ~10 kernel launches per time step unfused). On a CPU its training step measured
#: slower than the batched loop (docs/baselines.md), so there it serves evaluation only.
FUSED_TRAINING_DEVICES = ("cuda",)


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

    def initial(self, members: int, batch: int, like: torch.Tensor) -> torch.Tensor: ...

    def read(self, memory: torch.Tensor) -> torch.Tensor: ...

    def write(self, memory: torch.Tensor, h: torch.Tensor, plan: Any) -> torch.Tensor: ...


def positive_int(name: str, value: object) -> int:
    """``value`` if it is a positive integer, else a one-line CheBenchError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheBenchError(f"{name} must be a positive integer, got {value!r}")
    return value


def output_positions(task: Task, input_tokens: int) -> tuple[int, int]:
    """(placeholders appended, positions read out) for an input of ``input_tokens`` tokens:
    CHE's non-autoregressive layout (CHE experiments/utils.py make_model_with_empty_targets)
    appends ``output_length`` empty tokens and reads them; an in-place task reads its inputs."""
    if task.output_layout == "in_place":
        return 0, input_tokens
    if task.input_length(input_tokens) != input_tokens:
        raise CheBenchError(f"task {task.name!r} never produces inputs of {input_tokens} tokens")
    placeholders = task.output_length(input_tokens)
    return placeholders, placeholders


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
    builder sets it for the lstm only).
    """

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
        sizes: dict[str, Any],
        build_options: dict[str, Any],
    ) -> None:
        super().__init__()
        self.task, self.cell, self.memory = task, cell, memory
        self.architecture, self.members, self.fused = architecture, members, fused
        self.memory_budget_bytes = memory_budget_bytes
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
        inputs = self._member_inputs(inputs)
        input_tokens = inputs.shape[-1]
        placeholders, read = output_positions(self.task, input_tokens)
        empty = inputs.new_full((*inputs.shape[:2], placeholders), self.task.input_size)
        tokens = torch.cat([inputs, empty], dim=-1)
        batch = tokens.shape[1]
        sub_batch = batch
        if not torch.is_grad_enabled():
            row_bytes = self.query_row_bytes(input_tokens)
            sub_batch = max(1, min(batch, self.memory_budget_bytes // row_bytes))
        parts = [
            self._hidden_outputs(part, input_tokens, read) for part in tokens.split(sub_batch, 1)
        ]
        hidden = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return self.head(torch.relu(hidden))

    def _member_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` as ``[M, B, n]``, checked (ids index the members' input tables)."""
        if inputs.dim() == 2:
            inputs = inputs.expand(self.members, -1, -1)
        elif inputs.dim() != 3 or inputs.shape[0] != self.members:
            raise CheBenchError(
                f"inputs must be [B, n] or [{self.members}, B, n], got {list(inputs.shape)}"
            )
        # Host tensors only: on a GPU the check would wait for the device (batches are
        # checked where they are made, ``che_bench.train.metrics.check_token_ids``).
        if (
            inputs.shape[-1]
            and not inputs.is_cuda
            and (int(inputs.min()) < 0 or int(inputs.max()) >= self.task.input_size)
        ):
            raise CheBenchError(f"input ids must lie in 0..{self.task.input_size - 1}")
        return inputs

    def _hidden_outputs(self, tokens: torch.Tensor, input_tokens: int, read: int) -> torch.Tensor:
        if (
            self.fused
            and self.members == 1
            and (not torch.is_grad_enabled() or tokens.device.type in FUSED_TRAINING_DEVICES)
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
