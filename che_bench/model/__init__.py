"""The models: the transformer encoder, layers with a member axis, DAPE."""

from che_bench.model.encoder import Encoder, build_model
from che_bench.model.packs import member_state_dict, stack_members

__all__ = ["Encoder", "build_model", "member_state_dict", "stack_members"]
