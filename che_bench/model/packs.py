"""Packs of models: several models built alike, each from its own seed, held side by side as
one model's members, and one member taken back out as a one-member model's weights."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, cast

import torch

from che_bench.errors import CheBenchError
from che_bench.members import load_member_states
from che_bench.model.base import BenchModel

ModelT = TypeVar("ModelT", bound=BenchModel)


def stack_members(models: Sequence[ModelT]) -> ModelT:
    """One model holding the members of ``models`` (built alike, each from its own seed) side
    by side, in order; its parameters are copies. A randomized encoding's draw generators
    start from member 0's seed: seed them (``seed_draws``) before training or evaluating."""
    first = models[0]
    if any(model.build_key() != first.build_key() for model in models):
        raise CheBenchError("only models built with the same task, architecture and options stack")
    device = next(first.parameters()).device
    with torch.random.fork_rng(devices=[]):  # the pack's own initialisation is overwritten
        pack = first.with_members(sum(model.members for model in models))
    return cast(ModelT, load_member_states(pack, models).to(device))


def member_state_dict(model: BenchModel, member: int) -> dict[str, torch.Tensor]:
    """The weights of one member, as a one-member model's ``state_dict`` (fresh copies, so
    that saving one never writes the whole pack's storage)."""
    return {
        name: tensor[member : member + 1].clone() for name, tensor in model.state_dict().items()
    }
