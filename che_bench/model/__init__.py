"""The models: the transformer encoder, layers with a member axis, DAPE, and what a plugin's
model builds on (``BenchModel``, the contract; ``register_model``, its registration)."""

from che_bench.model.architectures import register_model
from che_bench.model.base import BenchModel
from che_bench.model.encoder import Encoder, build_model
from che_bench.model.packs import member_state_dict, stack_members

__all__ = [
    "BenchModel",
    "Encoder",
    "build_model",
    "member_state_dict",
    "register_model",
    "stack_members",
]
