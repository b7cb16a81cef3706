"""What che-bench calls on a model: the contract of the transformer encoder, the recurrent
baselines and a plugin's model (``che_bench.model.architectures.register_model``).

A model is built as ``cls(task, members=M, **options)`` and holds ``M`` models side by side
(``che_bench.members``: every parameter ``[M, ...]``, member m initialised in turn from
torch's global RNG). ``forward(inputs)`` takes int64 token ids ``[B, n]`` (the same
sequences for every member) or ``[M, B, n]`` and returns logits
``[M, B, task.output_length(n), task.output_size]``: at appended output positions, or at the
inputs for an in-place task (``task.output_layout``). It must accept the keywords training
and evaluation pass (``draws``, ``evaluating``, ``dropout_seeds``) and may ignore them.

Everything else has a default here for a model that draws nothing at random and does not
split its forward pass to fit a memory budget; the encoder overrides all of it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from che_bench.tasks.base import Task

#: The evaluation memory budget of a model that has not been given one (1 GiB).
DEFAULT_MEMORY_BUDGET = 1 << 30


class BenchModel(nn.Module):
    """Base class of every model che-bench trains (see the module docstring).

    Class attributes a registered model sets: ``name`` (its registry name), ``label`` (how
    tables and plots name it; default: the name), ``defaults`` (every option it takes, with
    its default: the run records the options given, ``describe`` all of them) and
    ``presets`` (run settings it trains with under a preset, where they differ from the
    transformer's, e.g. ``{"paper": {"steps": 1_000_000}}``)."""

    name: ClassVar[str] = ""
    label: ClassVar[str | None] = None
    defaults: ClassVar[dict[str, Any]] = {}
    presets: ClassVar[dict[str, dict[str, Any]]] = {}

    task: Task
    members: int
    #: What the model was built with besides task and members (its resolved options).
    build_options: dict[str, Any]
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET

    # -- packs ------------------------------------------------------------------------------

    def with_members(self, members: int) -> BenchModel:
        """A model built alike with ``members`` members (freshly initialised)."""
        return type(self)(self.task, members=members, **self.build_options)

    def build_key(self) -> str:
        """Equal for models built alike (which ``stack_members`` can pack)."""
        return json.dumps(
            [type(self).__qualname__, self.task.name, self.task.params(), self.build_options],
            sort_keys=True,
            default=repr,
        )

    # -- random draws (randomized encodings): none by default -------------------------------

    def seed_draws(self, seeds: Sequence[int]) -> None:
        """Seed each member's own draws (one seed per member)."""
        if len(seeds) != self.members:
            raise ValueError(f"{len(seeds)} seeds for {self.members} members")

    def draw_states(self) -> list[Any]:
        """Each member's draw state, for a checkpoint."""
        return [None] * self.members

    def set_draw_states(self, states: Sequence[Any]) -> None:
        """Restore ``draw_states``' result."""
        if len(states) != self.members:
            raise ValueError(f"{len(states)} draw states for {self.members} members")

    def sample_draws(self, input_tokens: int, *, evaluating: bool | None = None) -> Any:
        """What one forward pass over inputs of ``input_tokens`` tokens draws (None: nothing)."""
        return None

    def sample_dropout_seeds(self, batch: int) -> torch.Tensor | None:
        """Per-sequence dropout seeds of an evaluation with dropout on (None: no dropout)."""
        return None

    # -- memory budget of a forward pass without gradients ----------------------------------

    def set_memory_budget(self, budget_bytes: int) -> None:
        self.memory_budget_bytes = budget_bytes

    def query_row_bytes(self, input_tokens: int, device: torch.device | None = None) -> int:
        """The least memory a forward pass can be split down to (0: it is not split)."""
        return 0

    # -- inspection -------------------------------------------------------------------------

    def max_input_tokens(self) -> int | None:
        """The longest input the model takes (None: no limit)."""
        return None

    def describe(self) -> dict[str, Any]:
        """The resolved configuration of one member, recorded with its results."""
        return {
            "architecture": self.name,
            "task": self.task.name,
            "task_params": self.task.params(),
            "parameters": sum(p.numel() for p in self.parameters()) // self.members,
        }
