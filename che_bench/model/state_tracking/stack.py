"""The frame every state-tracking model shares: token embedding -> residual blocks -> final
norm -> linear read-out (spec state_tracking.md 1.0, the formal-language harness of Beck et
al. 2024 and Grazzi et al. 2025), in CHE's non-autoregressive layout.

Layout: as CHE's recurrent baselines, ``output_length(n)`` empty tokens (id ``input_size``)
are appended after the ``n`` inputs and the logits are read there (an in-place task reads its
inputs); the models are causal, so a read-out position sees the whole input and nothing after
it. The read-out covers the task's output classes (``task.output_size``), not the vocabulary
as the harness's LM head does: a class outside the answer set can never be predicted, as in
every che-bench model.

Every parameter has a leading member axis ``[M, ...]`` (``che_bench.members``); member m is
initialised in turn (embedding, blocks, norm, read-out) from torch's global RNG.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from che_bench.errors import CheBenchError
from che_bench.members import MemberEmbedding, MemberLinear, init_members_
from che_bench.model.base import BenchModel, output_positions, positive_int
from che_bench.model.state_tracking.layers import head_size
from che_bench.model.state_tracking.position_wise import read_out_positions
from che_bench.tasks.base import Task

FLOAT_BYTES = 4

#: Options every state-tracking model takes: the formal-language configs of Grazzi et al.
#: (spec 2.4: 2 layers, width 128, 4 heads) and che-bench's evaluation memory budget.
COMMON_DEFAULTS: dict[str, Any] = {
    "layers": 2,
    "width": 128,
    "heads": 4,
    "memory_budget_bytes": 1 << 30,
}


class StateTrackingModel(BenchModel):
    """Embedding -> ``layers`` blocks -> final norm -> read-out; a subclass sets ``name``,
    ``label``, ``defaults`` (``COMMON_DEFAULTS`` plus its own), and builds its parts in
    ``make_block`` and ``make_final_norm`` (and re-initialises them in ``init_embedding``,
    ``init_head``)."""

    defaults: ClassVar[dict[str, Any]] = COMMON_DEFAULTS
    #: Activations a forward pass holds per token, in multiples of the width (the memory
    #: budget's estimate of one sequence; ``extra_floats`` adds what grows faster than T).
    activation_widths: ClassVar[int] = 16
    causal_outputs = True
    reads_lengths = True
    #: Activations per read-out position beyond those, in multiples of the width: a last
    #: block that runs its position-wise part at the read positions only holds them there
    #: on top of its recurrence's outputs (all positions of a tagging task, one of parity).
    read_out_widths: ClassVar[int] = 0

    def __init__(self, task: Task, members: int = 1, **options: Any) -> None:
        super().__init__()
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            raise CheBenchError(
                f"{self.name} takes no option {', '.join(unknown)} "
                f"(options: {', '.join(self.defaults)})"
            )
        self.task, self.members = task, members
        self.settings = self.check_options({**self.defaults, **options})
        self.build_options = dict(self.settings)
        self.memory_budget_bytes = self.settings["memory_budget_bytes"]
        width = self.settings["width"]
        # The empty output token is class input_size (CHE's layout).
        self.embedding = MemberEmbedding(members, task.input_size + 1, width, std=1.0)
        init_members_(self.embedding.weight, self.init_embedding)
        self.blocks = nn.ModuleList(self.make_block(layer) for layer in range(self.layers))
        self.norm = self.make_final_norm()
        self.head = MemberLinear(members, width, task.output_size, bias=False, init="torch")
        init_members_(self.head.weight, self.init_head)

    # -- what a subclass defines --------------------------------------------------------

    def check_options(self, settings: dict[str, Any]) -> dict[str, Any]:
        """``settings`` checked (a subclass checks its own and calls this); ``heads`` only
        where the model has heads (Mamba-1 leaves it out of its ``defaults``)."""
        for key in ("layers", "width", "heads", "memory_budget_bytes"):
            if key in settings:
                positive_int(key, settings[key])
        if "heads" in settings:
            head_size(settings["width"], settings["heads"])
        return settings

    def make_block(self, layer: int) -> nn.Module:
        """Block ``layer`` (0-based): ``[M, B, T, width] -> [M, B, T, width]``, its residual
        connections included."""
        raise NotImplementedError

    def make_final_norm(self) -> nn.Module | None:
        """The norm before the read-out (None: none)."""
        raise NotImplementedError

    def init_embedding(self, weight: torch.Tensor) -> None:
        """One member's embedding table ``[V, width]``: ``nn.Embedding``'s N(0, 1)."""
        nn.init.normal_(weight)

    def init_head(self, weight: torch.Tensor) -> None:
        """One member's read-out ``[classes, width]`` (default: ``nn.Linear``'s, as built)."""

    def extra_floats(self, tokens: int) -> int:
        """Floats per sequence beyond ``activation_widths * width`` per token."""
        return 0

    def last_block(self, block: nn.Module, x: torch.Tensor, read: int) -> torch.Tensor:
        """The last block's output at the last ``read`` positions, the read-out's: here the
        block runs at every position and is cut after (a model whose block can leave out the
        positions nothing reads overrides this)."""
        return read_out_positions(block(x), read)

    # -- shared ---------------------------------------------------------------------------

    @property
    def layers(self) -> int:
        return int(self.settings["layers"])

    @property
    def width(self) -> int:
        return int(self.settings["width"])

    @property
    def heads(self) -> int:
        return int(self.settings["heads"])

    def query_row_bytes(self, input_tokens: int, device: torch.device | None = None) -> int:
        """Bytes one sequence (every member) holds during a forward pass without gradients."""
        placeholders, read = output_positions(self.task, input_tokens)
        tokens = input_tokens + placeholders
        floats = tokens * self.width * self.activation_widths + self.extra_floats(tokens)
        floats += read * self.width * self.read_out_widths
        return FLOAT_BYTES * self.members * floats

    def forward(
        self,
        inputs: torch.Tensor,
        draws: Any = None,
        *,
        evaluating: bool | None = None,
        dropout_seeds: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[M, B, output_length(n), output_size]`` for ids ``[B, n]`` (shared by the
        members) or ``[M, B, n]``. Without gradients the batch is split to fit the memory
        budget. ``lengths`` (a mixed-length batch, ``reads_lengths``): each sequence's input
        tokens ``[B]``, read as ``with_sequence_lengths`` says. The other keywords are part
        of the contract and unused (nothing is drawn)."""
        inputs = self.member_inputs(inputs)
        # An in-place task reads every position: its padding is masked out of the loss and
        # the counts, so a mixed batch needs no per-sequence read-out there.
        if lengths is not None and self.task.output_layout != "in_place":
            tokens, positions = self.with_sequence_lengths(inputs, lengths)
            return self._logits(tokens, positions.shape[-1], positions)
        tokens, read = self.with_output_tokens(inputs)
        return self.in_sub_batches(lambda part: self._logits(part, read), tokens, inputs.shape[-1])

    def with_sequence_lengths(
        self, inputs: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A mixed-length batch's tokens and read-out positions ``[B, read]``: each row's own
        ``lengths[b]`` inputs, then the empty output tokens of CHE's layout in place of its
        padding (every position after its inputs; the model is causal, so nothing it reads
        sees the rest), read there."""
        placeholders = self.task.output_length(int(lengths.min()))  # one for every row
        width = inputs.shape[-1] + placeholders
        tokens = inputs.new_full((*inputs.shape[:2], width), self.task.input_size)
        inside = torch.arange(inputs.shape[-1], device=inputs.device) < lengths[:, None]
        tokens[..., : inputs.shape[-1]] = torch.where(inside, inputs, self.task.input_size)
        return tokens, lengths[:, None] + torch.arange(placeholders, device=inputs.device)

    def _logits(
        self, tokens: torch.Tensor, read: int, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The logits at the last ``read`` positions, or at ``positions`` ``[B, read]``."""
        x = self.embedding(tokens)
        *earlier, last = self.blocks
        for block in earlier:
            x = block(x)
        if positions is None:
            x = self.last_block(last, x, read)
        else:
            x = block_output_at(last(x), positions)
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), **self.settings}


def block_output_at(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x [M, B, T, W]`` at each sequence's ``positions`` ``[B, read]``: ``[M, B, read, W]``."""
    index = positions[None, :, :, None].expand(x.shape[0], -1, -1, x.shape[-1])
    return x.gather(2, index)
