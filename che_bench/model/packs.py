"""Packs of encoders: several models built alike, each from its own seed, held side by side as
one model's members, and one member taken back out as a one-member model's weights."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from che_bench.errors import CheBenchError
from che_bench.members import (
    load_member_states,
)
from che_bench.model.encoder import Encoder, build_model


def stack_members(models: Sequence[Encoder]) -> Encoder:
    """One model holding the members of ``models`` (built alike, each from its own seed) side
    by side, in order; its parameters are copies. The draw generators start from member 0's
    seed: seed them (``seed_draws``) before training or evaluating."""
    first = models[0]
    if any(
        model.build_options != first.build_options
        or model.task.params() != first.task.params()
        or (model.task.name, model.encoding.name, model.kernel)
        != (first.task.name, first.encoding.name, first.kernel)
        for model in models
    ):
        raise CheBenchError("only models built with the same task, encoding and options stack")
    with torch.random.fork_rng(devices=[]):  # the pack's own initialisation is overwritten
        pack = build_model(
            first.task,
            first.encoding.name,
            first.kernel,
            members=sum(model.members for model in models),
            **first.build_options,
        )
    return load_member_states(pack, models).to(first.embedding.weight.device)


def member_state_dict(model: Encoder, member: int) -> dict[str, torch.Tensor]:
    """The weights of one member, as a one-member model's ``state_dict`` (fresh copies, so
    that saving one never writes the whole pack's storage)."""
    return {
        name: tensor[member : member + 1].clone() for name, tensor in model.state_dict().items()
    }
