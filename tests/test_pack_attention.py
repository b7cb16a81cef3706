"""Packs of bias-carrying encodings keep PyTorch's fused attention: SDPA is called with 4-D
tensors (members folded into heads), and a pack of M saves for backward about M times what
one member saves (the unfused fallback kept every [M, B, H, T, T] map)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from che_bench.encodings import list_encodings
from che_bench.model.encoder import build_model, stack_members
from che_bench.tasks import get_task

BIAS_ENCODINGS = sorted(cls.name for cls in list_encodings() if cls.carries_bias)
SIZES = dict(layers=1, dim=32, heads=4, ffn=32, dropout=0.0)


def pack_of(pe: str, members: int, task_name: str = "reverse_string"):
    task = get_task(task_name)
    models = []
    for seed in range(members):
        torch.manual_seed(seed)
        models.append(build_model(task, pe, None, **SIZES))
    return task, models[0] if members == 1 else stack_members(models)


def test_the_bias_encodings_are_the_papers():
    assert {"alibi", "fire", "kerple", "kerple_power", "random_alibi", "t5"} <= set(BIAS_ENCODINGS)


@pytest.mark.parametrize("pe", BIAS_ENCODINGS)
def test_a_pack_calls_fused_attention_in_4d_and_matches_its_members(pe):
    task, pack = pack_of(pe, 3)
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append([t.dim() for t in (*args, kwargs.get("attn_mask")) if t is not None])
        return real(*args, **kwargs)

    inputs = torch.randint(0, task.input_size, (2, 9))
    pack.eval()
    with mock.patch.object(F, "scaled_dot_product_attention", spy):
        logits = pack(inputs)
    assert calls and all(dims == [4] * len(dims) for dims in calls)
    # Pack == members alone, through the folded path.
    for member in range(3):
        torch.manual_seed(member)
        alone = build_model(task, pe, None, **SIZES).eval()
        alone.seed_draws([0])
        torch.testing.assert_close(logits[member], alone(inputs)[0], rtol=1e-5, atol=1e-5)


def saved_bytes(model, inputs) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of one forward."""
    total = 0

    def pack_hook(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda tensor: tensor):
        model(inputs).sum().backward()
    return total


@pytest.mark.parametrize("pe", BIAS_ENCODINGS)
def test_a_pack_of_m_saves_about_m_times_one_member(pe):
    task, one = pack_of(pe, 1, "duplicate_string")
    _, pack = pack_of(pe, 4, "duplicate_string")
    inputs = torch.randint(0, task.input_size, (8, 40))
    one.train(), pack.train()
    alone = saved_bytes(one, inputs)
    packed = saved_bytes(pack, inputs)
    # On a CPU a bias that needs a gradient keeps SDPA on its math path even for one member
    # (so this compares like with like); a fixed bias (random ALiBi) shows the fallback.
    assert packed <= 4 * alone * 1.25, (packed, alone)
