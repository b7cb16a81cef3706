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
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from che_bench.errors import CheBenchError
from che_bench.tasks.base import Task

#: The evaluation memory budget of a model that has not been given one (1 GiB).
DEFAULT_MEMORY_BUDGET = 1 << 30


class BenchModel(nn.Module):
    """Base class of every model che-bench trains (see the module docstring).

    A subclass's ``__init__(task, members=1, **options)`` calls ``super().__init__()`` and
    sets ``self.task``, ``self.members`` and ``self.build_options`` (the options it was
    built with: ``with_members`` and ``build_key`` rebuild and compare models from them).

    Class attributes a registered model sets: ``name`` (its registry name), ``label`` (how
    tables and plots name it; default: the name), ``defaults`` (every option it takes, with
    its default: the run records the options given, ``describe`` all of them), ``presets``
    (run settings it trains with under a preset, where they differ from the transformer's,
    e.g. ``{"paper": {"steps": 1_000_000}}``) and ``inert_options`` (the options of
    ``defaults`` that change neither its parameters nor its outputs, such as an evaluation
    memory budget; ``check-model`` checks that every other option changes one of them),
    ``option_choices`` (the values an option takes that ``check-model`` cannot guess, a
    string's above all: it builds the model with each and checks that each changes it) and
    ``causal_outputs`` (the logits at position t read the inputs up to t only; checked on an
    in-place task). A model whose fast ``forward`` (a chunked scan, say) has a plain, slow
    form overrides ``reference_forward``: ``check-model`` compares the two."""

    name: ClassVar[str] = ""
    label: ClassVar[str | None] = None
    defaults: ClassVar[dict[str, Any]] = {}
    presets: ClassVar[dict[str, dict[str, Any]]] = {}
    #: Options that change neither parameters nor outputs (by default the evaluation memory
    #: budget, an option named as the attribute that holds it).
    inert_options: ClassVar[frozenset[str]] = frozenset({"memory_budget_bytes"})
    #: Every value an option takes, where ``check-model`` cannot make one up (a string, a
    #: list of strings): ``{"gate": ("sigmoid", "exp")}``. Each must build and change the
    #: parameters or the logits of a model built with the default.
    option_choices: ClassVar[dict[str, tuple[Any, ...]]] = {}
    #: True when the logits at position t depend on the inputs up to t only (a recurrence
    #: read left to right, not told the input's length); ``check-model`` then checks it on
    #: an in-place task. A class attribute, or set per model where options decide it.
    causal_outputs: bool = False
    #: True for a model trained with teacher forcing: the training step then passes the
    #: targets (``forward(inputs, draws, targets=...)``, ``[M, B, L]``); evaluation never does.
    uses_targets: ClassVar[bool] = False
    #: True for a model that trains on mixed-length batches (``batch_lengths = "mixed"``):
    #: its ``forward`` then takes ``lengths`` (``[B]``, each sequence's input tokens, the
    #: rest of its row padding) and reads each sequence's outputs after its own inputs.
    reads_lengths: ClassVar[bool] = False

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

    def member_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, n]`` (shared by the members) or ``[M, B, n]`` as ``[M, B, n]``;
        a bad shape or an id outside ``0..input_size-1`` (which would read another row of an
        input table silently) is a one-line CheBenchError."""
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
            and inputs.device.type == "cpu"
            and (int(inputs.min()) < 0 or int(inputs.max()) >= self.task.input_size)
        ):
            raise CheBenchError(f"input ids must lie in 0..{self.task.input_size - 1}")
        return inputs

    def with_output_tokens(self, inputs: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``inputs [M, B, n]`` followed by the empty output tokens (id ``input_size``) of
        CHE's layout (``output_positions``), and how many positions at the end are read out."""
        placeholders, read = output_positions(self.task, inputs.shape[-1])
        if not placeholders:
            return inputs, read
        empty = inputs.new_full((*inputs.shape[:2], placeholders), self.task.input_size)
        return torch.cat([inputs, empty], dim=-1), read

    def in_sub_batches(
        self,
        function: Callable[[torch.Tensor], torch.Tensor],
        tokens: torch.Tensor,
        input_tokens: int,
    ) -> torch.Tensor:
        """``function`` of ``tokens [M, B, T]``, joined along the batch axis; without
        gradients it runs on as many sequences at a time as ``query_row_bytes(input_tokens)``
        fits into the memory budget (at least one)."""
        sub_batch = tokens.shape[1]
        if not torch.is_grad_enabled():
            row_bytes = self.query_row_bytes(input_tokens)
            if row_bytes > 0:
                sub_batch = max(1, min(sub_batch, self.memory_budget_bytes // row_bytes))
        parts = [function(part) for part in tokens.split(sub_batch, dim=1)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

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
        """The bytes a forward pass without gradients may hold (evaluation sets it from the
        device's free memory and halves it after running out)."""
        self.memory_budget_bytes = budget_bytes

    def query_row_bytes(self, input_tokens: int, device: torch.device | None = None) -> int:
        """The least memory a forward pass can be split down to (0: it is not split)."""
        return 0

    # -- the slow form ----------------------------------------------------------------------

    def reference_forward(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The logits of ``forward(inputs)`` computed the plain, slow way (a recurrence one
        token at a time, where ``forward`` runs a chunked scan), or None: the model declares
        none (the default). ``check-model`` compares the two, values and every parameter's
        gradient, at lengths up to 500, in evaluation mode (no dropout) with gradients on."""
        return None

    # -- optimisation -----------------------------------------------------------------------

    def no_weight_decay(self) -> set[str]:
        """Names (as ``named_parameters`` gives them) of the parameters weight decay leaves
        alone: by default ``default_no_weight_decay``'s. A model whose parameters that rule
        misreads (say a decay rate named ``weight``) overrides this."""
        return default_no_weight_decay(self)

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


def positive_int(name: str, value: object) -> int:
    """``value`` if it is a positive integer, else a one-line CheBenchError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheBenchError(f"{name} must be a positive integer, got {value!r}")
    return value


def non_negative_int(name: str, value: object) -> int:
    """``value`` if it is an integer >= 0, else a one-line CheBenchError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheBenchError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def switch(name: str, value: object) -> bool:
    """``value`` if it is true or false, else a one-line CheBenchError."""
    if not isinstance(value, bool):
        raise CheBenchError(f"{name} must be true or false, got {value!r}")
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


def default_no_weight_decay(model: nn.Module) -> set[str]:
    """Every parameter but the weights of the layers: a parameter decays only when its own
    name contains ``weight`` and it belongs to no norm (a module or path named ``norm``) and
    no embedding (a module whose class name ends in ``Embedding``). This is the xLSTM
    harness's grouping ("weight" in the name, no "norm", the embedding left out), so biases,
    norm scales, embeddings and the parameters of state-space recurrences (Mamba's ``A_log``
    and ``D``, Gated DeltaNet's ``A_log`` and ``dt_bias``) are not decayed."""
    exempt = set()
    for module_name, module in model.named_modules():
        kind = type(module).__name__
        plain_module = "norm" not in kind.lower() and not kind.endswith("Embedding")
        for name, _ in module.named_parameters(prefix=module_name, recurse=False):
            if not (plain_module and "weight" in name.rsplit(".", 1)[-1] and "norm" not in name):
                exempt.add(name)
    return exempt
