"""CHE's recurrent baselines (CHE experiments/constants.py MODEL_BUILDERS): ``rnn``, ``lstm``,
``stack_rnn``, ``stack_lstm``, ``ndstack_rnn`` and ``tape_rnn``, with che-bench's member axis.

``build_recurrent(name, task, members=..., **options)`` builds one (initialised from torch's
global RNG); ``che_bench.model.packs.stack_members`` packs several, each built from its own
seed, and ``member_state_dict`` takes one member back out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from che_bench.errors import CheBenchError, accepted_text
from che_bench.model.base import positive_int, switch
from che_bench.model.recurrent.base import COMPUTATION_STEPS, Cell, Memory, RecurrentModel
from che_bench.model.recurrent.ndstack_rnn import NDStackMemory
from che_bench.model.recurrent.rnn import CELLS
from che_bench.model.recurrent.stack_rnn import StackMemory
from che_bench.model.recurrent.tape_rnn import TapeMemory
from che_bench.tasks.base import Task


@dataclass(frozen=True)
class Architecture:
    """A cell (``rnn``: hk.VanillaRNN, ``lstm``: hk.LSTM) and its memory (None, "stack",
    "ndstack", "tape")."""

    cell: str
    memory: str | None


ARCHITECTURES = {
    "rnn": Architecture("rnn", None),
    "lstm": Architecture("lstm", None),
    "stack_rnn": Architecture("rnn", "stack"),
    "stack_lstm": Architecture("lstm", "stack"),
    "ndstack_rnn": Architecture("rnn", "ndstack"),
    "tape_rnn": Architecture("rnn", "tape"),
}

#: How tables and plots name them (the CHE paper's names).
LABELS = {
    "rnn": "RNN",
    "lstm": "LSTM",
    "stack_rnn": "Stack-RNN",
    "stack_lstm": "Stack-LSTM",
    "ndstack_rnn": "NDStack-RNN",
    "tape_rnn": "Tape-RNN",
}

#: The run settings of CHE's protocol where they differ from the transformer's ``paper``
#: preset (DAPE V2's: 200,000 steps). The CHE paper (arXiv 2207.02098, ICLR 2023 version,
#: Appendix A.4) trains every architecture alike: Adam "for 1 000 000 steps", batches of 128,
#: lengths drawn uniformly from 1..40, score over 41..500; CHE's training loop has no
#: per-architecture setting either (experiments/training.py ClassicTrainingParams). The rest
#: is already the transformer's: batch 128 (experiments/example.py _BATCH_SIZE), gradient
#: clipping at global norm 1 (training.py max_grad_norm=1.), lengths 1..40 uniformly
#: (example.py UniformCurriculum), evaluation at 41..500 with 512 sequences in sub-batches of
#: 64 (training.py range_test_total_batch_size / range_test_sub_batch_size). The paper's grid,
#: 10 seeds x learning rates {1e-4, 3e-4, 5e-4} with the maximum score reported (Appendix
#: A.4), is a suite's (tasks/che_baselines.toml); the preset's single rate is the grid's first.
PRESETS: dict[str, dict[str, Any]] = {"paper": {"steps": 1_000_000}}

#: Options every architecture takes, with their defaults.
COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_size": 256,  # CHE experiments/example.py _ARCHITECTURE_PARAMS: hidden_size 256
    "memory_budget_bytes": 1 << 30,  # che-bench's evaluation budget (model.MODEL_DEFAULTS)
    # A one-member lstm evaluates with torch's fused kernel (same outputs, faster; see rnn.py).
    "fused": True,
    # CHE experiments/utils.py make_model_with_empty_targets (any model): this many times the
    # input length of computation tokens between the input and the empty output positions.
    COMPUTATION_STEPS: 0,
}
#: Options of each memory, with their defaults.
MEMORY_DEFAULTS: dict[str | None, dict[str, Any]] = {
    None: {},
    "stack": {
        # CHE's StackRNNCore takes stack_cell_size without a default; the CHE paper's stack
        # and tape hold elements of R^d "with d = 8" (Section 4). models/stack_rnn.py:
        # stack_size=30.
        "stack_cell_size": 8,
        "stack_size": 30,
    },
    "ndstack": {
        # CHE's NDStackRNNCore takes both without a default; DuSell & Chiang's released NS-RNN
        # runs (bdusell/nondeterministic-stack-rnn experiments/train/{dyck,unmarked-reversal}/
        # ns) use 2 states and 3 stack symbols (docs/baselines.md). CHE's defaults:
        # stack_size=30, read_states=False.
        "stack_states": 2,
        "stack_symbols": 3,
        "stack_size": 30,
        "read_states": False,
    },
    "tape": {
        # CHE experiments/example.py _ARCHITECTURE_PARAMS: memory_cell_size 8, memory_size 40.
        "memory_cell_size": 8,
        "memory_size": 40,
        # CHE models/tape_rnn.py TapeRNNCore: mlp_layers_size=(64, 64), n_tapes=1.
        "mlp_layers_size": (64, 64),
        "n_tapes": 1,
    },
}


def recurrent_defaults(name: str) -> dict[str, Any]:
    """Every option of architecture ``name`` with its default."""
    return {**COMMON_DEFAULTS, **MEMORY_DEFAULTS[_architecture(name).memory]}


def _architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise CheBenchError(
            f"unknown architecture {name!r}; choose from {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[name]


def _settings(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` over the defaults of ``name``, checked."""
    defaults = recurrent_defaults(name)
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise CheBenchError(
            f"{name} takes no option {', '.join(unknown)} ({accepted_text(defaults)})"
        )
    settings = {**defaults, **options}
    for key, value in settings.items():
        if key == "mlp_layers_size":
            settings[key] = tuple(positive_int(key, size) for size in value)
        elif key == COMPUTATION_STEPS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheBenchError(f"{key} must be a non-negative integer, got {value!r}")
        elif key == "read_states":
            switch(key, value)
        elif key != "fused":
            positive_int(key, value)
    return settings


def _memory(kind: str | None, members: int, settings: dict[str, Any]) -> Memory | None:
    hidden = settings["hidden_size"]
    if kind == "stack":
        return StackMemory(members, hidden, settings["stack_cell_size"], settings["stack_size"])
    if kind == "ndstack":
        return NDStackMemory(
            members,
            hidden,
            settings["stack_states"],
            settings["stack_symbols"],
            settings["stack_size"],
            settings["read_states"],
        )
    if kind == "tape":
        return TapeMemory(
            members,
            hidden,
            settings["memory_cell_size"],
            settings["memory_size"],
            settings["mlp_layers_size"],
            settings["n_tapes"],
        )
    return None


def build_recurrent(name: str, task: Task, *, members: int = 1, **options: Any) -> RecurrentModel:
    """CHE's recurrent baseline ``name`` for ``task``: one-hot inputs (``input_size`` classes
    plus the empty token), ``members`` models side by side, each initialised in turn from
    torch's global RNG (memory, then cell, then read-out). ``options``: see
    ``recurrent_defaults(name)``; anything else raises CheBenchError."""
    architecture = _architecture(name)
    settings = _settings(name, options)
    computation = settings[COMPUTATION_STEPS]
    if computation and task.output_layout == "in_place":
        raise CheBenchError(
            f"{COMPUTATION_STEPS} needs outputs after the input (CHE's layout); task "
            f"{task.name!r} reads its outputs at its inputs"
        )
    memory = _memory(architecture.memory, members, settings)
    extra = 0 if memory is None else memory.width
    # CHE experiments/utils.py make_model_with_empty_targets: one-hot of input_size + 1
    # classes, the empty output positions being class input_size; with computation tokens
    # one more (computation input_size, empty output input_size + 1).
    cell: Cell = CELLS[architecture.cell](
        members, task.input_size + 1 + (computation > 0), extra, settings["hidden_size"]
    )
    sizes = {
        key: value for key, value in settings.items() if key not in ("memory_budget_bytes", "fused")
    }
    if "mlp_layers_size" in sizes:
        sizes["mlp_layers_size"] = list(sizes["mlp_layers_size"])
    return RecurrentModel(
        task,
        cell,
        memory,
        architecture=name,
        members=members,
        memory_budget_bytes=settings["memory_budget_bytes"],
        fused=bool(settings["fused"]) and name == "lstm",
        computation_steps=computation,
        sizes=sizes,
        build_options=dict(options),
    )
