"""A GRU (``--arch gru``): an example of a plugin's model, built on ``BenchModel``.

It follows the conventions of che-bench's recurrent baselines (``che_bench.model.recurrent``):

* one-hot inputs, as a row lookup in a per-member table (one-hot times a matrix is that
  matrix's row), with one extra class, ``task.input_size``, for the empty output tokens;
* CHE's non-autoregressive layout: ``task.output_length(n)`` empty tokens are appended after
  the ``n`` inputs and the outputs are read there (an in-place task, ``output_layout ==
  "in_place"``, reads them at its inputs and appends nothing);
* a linear read-out of ``relu(h)``;
* every parameter has a leading member axis ``[M, ...]``, and each step is one batched
  product over members (``che_bench.members.MemberLinear``).

The cell is torch's ``nn.GRU``'s: ``r = sigmoid(W_ir x + b_ir + W_hr h + b_hr)``,
``z = sigmoid(W_iz x + b_iz + W_hz h + b_hz)``, ``c = tanh(W_ic x + b_ic + r * (W_hc h +
b_hc))``, ``h' = (1 - z) * c + z * h``, initialised as ``nn.GRU`` is (uniform within
``1/sqrt(hidden_size)``), from a zero state.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from che_bench.members import MemberLinear, init_members_
from che_bench.model import BenchModel, register_model
from che_bench.tasks.base import Task


@register_model
class GRU(BenchModel):
    """A GRU with a ReLU and linear read-out, in CHE's non-autoregressive layout."""

    name = "gru"
    label = "GRU"
    defaults = {"hidden_size": 64}  # noqa: RUF012  (BenchModel declares it a ClassVar)
    causal_outputs = True  # the output at t reads inputs 0..t only (check-model checks it)

    def __init__(self, task: Task, members: int = 1, hidden_size: int = 64) -> None:
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive integer, got {hidden_size!r}")
        self.task, self.members, self.hidden_size = task, members, hidden_size
        # What with_members and build_key rebuild the model from.
        self.build_options = {"hidden_size": hidden_size}
        bound = 1 / math.sqrt(hidden_size)
        # The input map's rows, one per token class (plus the empty token), with its bias.
        self.input_table = nn.Parameter(torch.empty(members, task.input_size + 1, 3 * hidden_size))
        init_members_(self.input_table, lambda rows: nn.init.uniform_(rows, -bound, bound))
        self.hidden_to_gates = MemberLinear(members, hidden_size, 3 * hidden_size, init="torch")
        self.head = MemberLinear(members, hidden_size, task.output_size)

    def forward(
        self,
        inputs: torch.Tensor,
        draws: Any = None,
        *,
        evaluating: bool | None = None,
        dropout_seeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[M, B, output_length(n), output_size]`` for ids ``[B, n]`` (shared by the
        members) or ``[M, B, n]``; the keywords are part of the contract and unused (the GRU
        draws nothing at random)."""
        inputs = self.member_inputs(inputs)  # [M, B, n], ids checked
        # The empty output tokens appended (none for an in-place task); the last `read` read.
        tokens, read = self.with_output_tokens(inputs)
        members, batch, steps = tokens.shape
        member_rows = torch.arange(members, device=inputs.device)[:, None]
        h = self.input_table.new_zeros(members, batch, self.hidden_size)
        outputs = []
        for step in range(steps):
            from_input = self.input_table[member_rows, tokens[:, :, step]]  # [M, B, 3H]
            from_hidden = self.hidden_to_gates(h)
            r_in, z_in, c_in = from_input.chunk(3, dim=-1)
            r_h, z_h, c_h = from_hidden.chunk(3, dim=-1)
            r, z = torch.sigmoid(r_in + r_h), torch.sigmoid(z_in + z_h)
            h = torch.lerp(torch.tanh(c_in + r * c_h), h, z)  # (1 - z) * c + z * h
            if step >= steps - read:
                outputs.append(h)
        if not outputs:
            return self.head(h.new_zeros(members, batch, 0, self.hidden_size))
        return self.head(torch.relu(torch.stack(outputs, dim=2)))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "hidden_size": self.hidden_size}
