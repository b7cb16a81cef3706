"""The CHE encoder: format, sizes, initialisation, chunking, invariances, errors."""

from __future__ import annotations

import json
import math
import weakref

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from che_bench.checks.conformance import check_pack_equals_members
from che_bench.encodings import AttentionHook, list_encodings
from che_bench.errors import CheBenchError
from che_bench.model.attention import Attention
from che_bench.model.encoder import build_model
from che_bench.model.packs import stack_members
from che_bench.tasks import get_task, list_tasks

TINY = {"layers": 1, "dim": 16, "heads": 2, "ffn": 32}
ENCODINGS = [cls.name for cls in list_encodings()]


def inputs_for(task, n, batch=2, seed=0):
    return torch.from_numpy(task.sample(n, batch, np.random.default_rng(seed)).inputs)


@pytest.mark.parametrize(
    "task_name, n, outputs",
    [("parity_check", 9, 1), ("duplicate_string", 6, 12), ("binary_addition", 7, 8),
     ("compute_sqrt", 7, 4), ("modular_arithmetic", 8, 1)],
)
def test_forward_returns_the_placeholder_logits(task_name, n, outputs):
    task = get_task(task_name)
    model = build_model(task, "none", **TINY)
    logits = model(inputs_for(task, n))
    assert logits.shape == (1, 2, outputs, task.output_size)  # [members, batch, outputs, classes]


def test_parameter_count_matches_the_reference_model():
    # Reference (spec tasks.md 3.1): 270 082 parameters for reverse_string, NOISY_RELATIVE.
    task = get_task("reverse_string")
    assert build_model(task, "random_relative").describe()["parameters"] == 270_082
    assert build_model(task, "none").describe()["parameters"] == 248_962
    # DAPE adds one unshared processor per layer: 2H*D + D + k*(D*H) + H (bias-carrying).
    with_dape = build_model(task, "alibi", kernel=3).describe()["parameters"]
    assert with_dape - 248_962 == 5 * (16 * 32 * 3 + 32 + 32 * 8 * 3 + 8)


def test_haiku_style_initialisation():
    torch.manual_seed(0)
    model = build_model(get_task("bucket_sort"), "none")
    embedding = model.embedding.weight
    assert embedding.shape == (1, 6, 64)  # one member; input_size 5 + the placeholder
    assert embedding.abs().max() <= 0.04 + 1e-6 and 0.012 < embedding.std() < 0.02
    ffn_in = model.blocks[0].ffn[0]
    assert ffn_in.weight.abs().max() <= 2 / math.sqrt(64) + 1e-6
    assert torch.all(ffn_in.bias == 0) and torch.all(model.head.bias == 0)
    assert model.blocks[0].attention.query.bias is None


def test_placeholder_id_is_the_input_size_and_embeddings_are_scaled():
    task = get_task("parity_check")
    model = build_model(task, "none", **TINY).eval()
    tokens = []
    model.blocks[0].register_forward_pre_hook(lambda module, args: tokens.append(args[0]))
    model(torch.tensor([[0, 1, 1]]))
    expected = model.embedding(torch.tensor([[[0, 1, 1, task.input_size]]])) * math.sqrt(16)
    torch.testing.assert_close(tokens[0], expected)


def test_embedding_dropout_only_for_encodings_that_add_to_the_embedding():
    task = get_task("parity_check")
    assert build_model(task, "sin_cos").embedding_dropout.p == 0.1
    assert build_model(task, "alibi").embedding_dropout.p == 0.0


def test_describe_is_complete_and_json_serialisable():
    model = build_model(get_task("reverse_string"), "kerple", kernel=3, dape_width=16, **TINY)
    described = model.describe()
    json.dumps(described)
    assert described["task"] == "reverse_string" and described["pe"] == "kerple"
    assert described["kernel"] == 3
    assert described["dape"] == {"width": 16, "variant": "concat_residual", "tril": False}
    assert described["train_max_tokens"] == 80 and described["layers"] == 1


def test_fused_attention_equals_the_explicit_path():
    torch.manual_seed(0)
    model = build_model(get_task("reverse_string"), "alibi", layers=2, causal=True).eval()
    x = inputs_for(get_task("reverse_string"), 12)
    assert all(block.attention.fused for block in model.blocks)
    with torch.no_grad():
        fused = model(x)
        for block in model.blocks:
            block.attention.fused = False
        explicit = model(x)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)


def test_row_chunks_are_used_without_gradients_only():
    task = get_task("duplicate_string")
    model = build_model(task, "none", 3, memory_budget_bytes=1 << 20, **TINY).eval()
    dape = model.blocks[0].attention.dape
    chunks, calls = [], []
    tile_filter = dape.tile_filter
    dape.tile_filter = lambda member, bias, rows, shape: (
        chunks.append(rows) or tile_filter(member, bias, rows, shape)
    )
    dape.register_forward_hook(lambda *args: calls.append(1))
    x = inputs_for(task, 100, batch=2)
    with torch.no_grad():
        model(x)
    assert len(chunks) > 1 and not calls  # row chunks, each through the tiles
    model(x).sum().backward()
    assert len(chunks) > 1 and len(calls) == 1


@pytest.mark.parametrize("kernel, invariant", [(None, True), (1, True), (3, False)])
def test_nope_is_permutation_invariant_unless_the_kernel_mixes_keys(kernel, invariant):
    task = get_task("parity_check")
    torch.manual_seed(0)
    model = build_model(task, "none", kernel, layers=2).eval()
    x = inputs_for(task, 20, batch=4)
    shuffled = x[:, torch.randperm(20, generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        difference = (model(x) - model(shuffled)).abs().max()
    assert (difference < 1e-5) == invariant, difference


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kernel": 2},
        {"kernel": 0},
        {"kernel": 3, "dape_variant": "sum"},
        {"kernel": 3, "dape_tril": "yes"},
        {"not_an_option": 1},
        {"dim": 60, "heads": 8},
        {"layers": 0},
        {"dropout": 1.5},
        {"train_length": 0},
    ],
)
def test_invalid_configurations_raise_one_clear_error(kwargs):
    with pytest.raises(CheBenchError):
        build_model(get_task("parity_check"), "none", **kwargs)


def test_errors_at_forward_time():
    task = get_task("duplicate_string")
    short = build_model(task, "random_sin_cos", noise_max_length=128, **TINY)
    with pytest.raises(CheBenchError):  # T = 150 > L = 128
        short(inputs_for(task, 50))
    with pytest.raises(CheBenchError):  # the placeholder id is not an input id
        build_model(task, "none", **TINY)(torch.tensor([[0, 1, task.input_size]]))
    with pytest.raises(CheBenchError):
        build_model(get_task("modular_arithmetic"), "none", **TINY)(torch.zeros(1, 4, dtype=torch.long))


def test_train_max_tokens_is_the_longest_training_input():
    model = build_model(get_task("duplicate_string"), "fire", train_length=20, **TINY)
    assert model.describe()["train_max_tokens"] == 60
    assert model.encoding.train_max_tokens == 60


def _forward_at_500(task_name, pe, kernel):
    task = get_task(task_name)
    model = build_model(task, pe, kernel, **TINY).eval()
    with torch.no_grad():
        logits = model(inputs_for(task, 500, batch=1))
    assert logits.shape == (1, 1, task.output_length(500), task.output_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("task_name", list_tasks())
def test_every_task_runs_at_n_500(task_name):
    _forward_at_500(task_name, "alibi", 3)


@pytest.mark.slow
@pytest.mark.parametrize("task_name", list_tasks())
@pytest.mark.parametrize("pe", ENCODINGS)
@pytest.mark.parametrize("kernel", [None, 1, 3])
def test_every_encoding_task_and_kernel_runs_at_n_500(task_name, pe, kernel):
    _forward_at_500(task_name, pe, kernel)


def test_attention_module_is_reusable_with_a_default_hook():
    from che_bench.encodings import AttentionHook

    attention = Attention(8, 2, AttentionHook(), None, causal=False, memory_budget_bytes=1 << 20)
    assert attention(torch.randn(1, 3, 5, 8)).shape == (1, 3, 5, 8)


class _LiveOutputs(TorchDispatchMode):
    """Counts the storages of ``nbytes`` bytes that operations make, alive at once."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes, self.alive, self.most = nbytes, 0, 0

    def _freed(self) -> None:
        self.alive -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {arg.untyped_storage().data_ptr() for arg in args if isinstance(arg, torch.Tensor)}
        for tensor in out if isinstance(out, tuple) else [out]:
            storage = tensor.untyped_storage()
            # (A view or an in-place result is no new storage.)
            if storage.nbytes() == self.nbytes and storage.data_ptr() not in seen:
                self.alive += 1
                self.most = max(self.most, self.alive)
                weakref.finalize(storage, self._freed)
        return out


def test_without_gradients_no_chunk_s_output_outlives_its_chunk():
    """Each row chunk's output goes into the layer's output as it comes: kept until joined,
    they lay among the next chunks' freed maps and fragmented the allocator's heap."""
    attention = Attention(8, 2, AttentionHook(), None, causal=False, memory_budget_bytes=1)
    x = torch.randn(1, 3, 10, 8)
    chunk_output = 4 * 3 * 2 * 1 * 4  # [M, B, H, 1 row, d_h] floats: one row per chunk
    with torch.no_grad(), _LiveOutputs(chunk_output) as outputs:
        attention(x)
    assert 1 <= outputs.most <= 2, outputs.most


@pytest.mark.parametrize("pe, kernel", [("kerple", 5), ("none", 7)])
def test_a_pack_with_a_wider_kernel_computes_what_its_members_compute_alone(pe, kernel):
    # Kernels none, 1 and 3: the conformance check over every encoding (test_conformance).
    assert check_pack_equals_members(pe, {}, kernels=(kernel,)) == []


def test_members_never_mix_not_even_through_a_diverged_member():
    task = get_task("reverse_string")
    torch.manual_seed(0)
    members = [build_model(task, "kerple", 3, **TINY).eval() for _ in range(2)]
    pack = stack_members(members).eval()
    with torch.no_grad():
        for parameter in pack.parameters():
            parameter[0] = float("nan")
    x = inputs_for(task, 6)
    logits = pack(x)
    assert torch.isnan(logits[0]).all()
    torch.testing.assert_close(logits[1], members[1](x)[0])
    logits.sum().backward()  # the NaN member's loss is part of the sum, as in training
    members[1](x).sum().backward()
    for packed, alone in zip(pack.parameters(), members[1].parameters()):
        torch.testing.assert_close(packed.grad[1], alone.grad[0])


def test_only_models_built_alike_stack():
    task = get_task("reverse_string")
    with pytest.raises(CheBenchError):
        stack_members([build_model(task, "alibi", **TINY), build_model(task, "kerple", **TINY)])
    with pytest.raises(CheBenchError):
        stack_members([build_model(task, "alibi", **TINY), build_model(task, "alibi", layers=2)])


@pytest.mark.parametrize("pe, kernel", [("none", None), ("alibi", None), ("kerple", 3), ("cope", 1),
                                       ("fox", None), ("stick_breaking", 1)])
def test_captured_attention_maps_are_the_ones_the_forward_pass_uses(pe, kernel,
                                                                   filter_implementation):
    task = get_task("reverse_string")
    torch.manual_seed(0)
    model = build_model(task, pe, kernel, layers=2, dim=16, heads=2, ffn=32).eval()
    x = inputs_for(task, 9)
    probabilities = []
    with torch.no_grad():
        plain = model(x)
        with model.capture_attention() as captured:
            with_capture = model(x)
        # What the layer multiplies with v: recompute the first layer's output from its maps.
        attention = model.blocks[0].attention
        h = model.encoding.embed(model.embedding(
            torch.cat([x, x.new_full((2, 9), task.input_size)], 1)[None]) * math.sqrt(16))
        q, k, v = (proj(h).view(1, 2, 18, 2, 8).transpose(2, 3)
                   for proj in (attention.query, attention.key, attention.value))
        probabilities = captured[0][0]["probabilities"]
        first_layer = attention.output(torch.matmul(probabilities, v).transpose(2, 3).reshape(1, 2, 18, 16))
        torch.testing.assert_close(first_layer, attention(h), atol=1e-5, rtol=1e-5)
    if kernel is None or filter_implementation == "chunks":
        assert torch.equal(plain, with_capture)
    else:  # captured maps take the chunks filter, which rounds unlike the native tiles
        torch.testing.assert_close(plain, with_capture, atol=1e-5, rtol=1e-5)
    assert len(captured) == 2 and all(len(layer) == 1 for layer in captured)
    for block, layer in zip(model.blocks, captured, strict=True):
        maps = layer[0]
        torch.testing.assert_close(maps["probabilities"].sum(-1), torch.ones(1, 2, 2, 18))
        assert maps["scores"].shape == (1, 2, 2, 18, 18)
        assert (maps["logits"] is None) == (kernel is None)
        expected = maps["scores"] if kernel is None else maps["logits"]
        # the softmax, or the encoding's own normalisation (stick-breaking)
        normalised = block.attention.hook.normalise(expected, slice(0, 18), None, None)
        torch.testing.assert_close(maps["probabilities"], normalised)
    assert all(block.attention.capture is None for block in model.blocks)
