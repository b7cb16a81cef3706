"""PaTH's scores (``che_bench.encodings.path_transform``) and parameters (``path_parameters``):
the fast form against the plain recurrence and an independent float64 computation with explicit
``d x d`` matrix products, causal and bidirectional, for several block sizes and row chunkings,
gradients included; the forget bias; fla's naive reference where it runs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from che_bench.encodings.path_parameters import INIT_STD, W_KERNEL, PathProjections
from che_bench.encodings.path_transform import (
    BLOCK,
    Householders,
    forget_bias,
    path_scores_recurrent,
    prepare_path,
)
from che_bench.members import load_member_states

CHUNKINGS = {
    "whole": lambda length: [slice(0, length)],
    "uneven": lambda length: [slice(0, 3), slice(3, length - 2), slice(length - 2, length)],
    "single rows": lambda length: [slice(i, i + 1) for i in range(length)],
}


def householder_matrices(factors: Householders) -> torch.Tensor:
    """``I - beta_t w_t w_t^T`` as explicit ``[..., T, d, d]`` float64 matrices."""
    w, beta = factors.w.double(), factors.beta.double()
    eye = torch.eye(w.shape[-1], dtype=torch.float64)
    return eye - beta[..., None, None] * w[..., :, None] * w[..., None, :]


def explicit_scores(q, k, left: Householders, right: Householders | None = None):
    """Scaled scores pair by pair from the definition: ``q_i^T H_i ... H_{j+1} k_j`` (j <= i) and,
    bidirectional, ``q_i^T H'_i ... H'_{j-1} k_j`` (j > i); zero right of the diagonal if causal."""
    q, k = q.double(), k.double()
    length, dim = q.shape[-2:]
    lefts = householder_matrices(left)
    rights = None if right is None else householder_matrices(right)
    scores = torch.zeros(*q.shape[:-2], length, length, dtype=torch.float64)
    for i in range(length):
        for j in range(length):
            if j > i and rights is None:
                continue
            product = torch.eye(dim, dtype=torch.float64).expand(*q.shape[:-2], dim, dim)
            factors = [lefts[..., s, :, :] for s in range(i, j, -1)] if j <= i else []
            factors += [rights[..., s, :, :] for s in range(i, j)] if j > i else []
            for factor in factors:
                product = product @ factor
            scores[..., i, j] = (q[..., i, None, :] @ product @ k[..., j, :, None])[..., 0, 0]
    return scores / math.sqrt(dim)


def random_factors(shape, length, dim, dtype=torch.float32, low=0.0, high=2.0):
    w = F.normalize(torch.randn(*shape, length, dim, dtype=dtype), dim=-1)
    return Householders(w, low + (high - low) * torch.rand(*shape, length, dtype=dtype))


def random_case(length=11, dim=4, dtype=torch.float32, shape=(2, 3)):
    torch.manual_seed(length * 10 + dim)
    q, k = torch.randn(2, *shape, length, dim, dtype=dtype).unbind(0)
    return (
        q,
        k,
        random_factors(shape, length, dim, dtype),
        random_factors(shape, length, dim, dtype),
    )


def by_chunks(prepared, chunks):
    return torch.cat([prepared.scores(rows) for rows in chunks], dim=-2)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_the_recurrence_is_the_definition(bidirectional):
    q, k, left, right = random_case(dtype=torch.float64)
    right = right if bidirectional else None
    recurrent = path_scores_recurrent(q, k, left, right)
    torch.testing.assert_close(recurrent, explicit_scores(q, k, left, right), rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("block", [1, 3, 4, 64])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_the_fast_form_is_the_definition(bidirectional, block, chunking):
    q, k, left, right = random_case()
    right = right if bidirectional else None
    prepared = prepare_path(q, k, left, right, block=block)
    fast = by_chunks(prepared, CHUNKINGS[chunking](q.shape[-2]))
    assert fast.dtype == torch.float32 and fast.shape == (2, 3, 11, 11)
    expected = explicit_scores(q, k, left, right)
    torch.testing.assert_close(fast.double(), expected, rtol=0, atol=2e-6)
    torch.testing.assert_close(fast, path_scores_recurrent(q, k, left, right), rtol=0, atol=2e-6)


def test_in_float64_the_fast_form_agrees_to_float64_rounding():
    q, k, left, right = random_case(length=9, dtype=torch.float64)
    fast = by_chunks(prepare_path(q, k, left, right, block=4), CHUNKINGS["uneven"](9))
    torch.testing.assert_close(fast, explicit_scores(q, k, left, right), rtol=0, atol=1e-12)


def test_a_longer_sequence_over_many_blocks_matches_the_recurrence():
    q, k, left, right = random_case(length=150, dim=8, shape=(2,))
    double = [Householders(*(x.double() for x in factors)) for factors in (left, right)]
    expected = path_scores_recurrent(q.double(), k.double(), *double)
    prepared = prepare_path(q, k, left, right)  # three blocks of 50
    fast = by_chunks(prepared, [slice(0, 70), slice(70, 129), slice(129, 150)])
    torch.testing.assert_close(fast.double(), expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_gradients_of_the_fast_form_pass_gradcheck(bidirectional):
    q, k, left, right = random_case(length=5, dim=3, dtype=torch.float64, shape=(1,))
    inputs = [x.clone().requires_grad_() for x in (q, k, *left, *right)]

    def scores(q, k, w, beta, w_right, beta_right):
        right = Householders(w_right, beta_right) if bidirectional else None
        prepared = prepare_path(q, k, Householders(w, beta), right, block=2)
        return by_chunks(prepared, [slice(0, 2), slice(2, 5)])

    assert torch.autograd.gradcheck(scores, inputs, fast_mode=True)


def test_gradients_of_the_fast_form_match_the_recurrence():
    q, k, left, right = random_case(length=23, dim=8)
    weights = torch.randn(2, 3, 23, 23)
    gradients = []
    for fast in (True, False):
        inputs = [x.clone().requires_grad_() for x in (q, k, *left, *right)]
        factors = Householders(*inputs[2:4]), Householders(*inputs[4:6])
        if fast:
            scores = by_chunks(prepare_path(*inputs[:2], *factors, block=8), [slice(0, 23)])
        else:
            scores = path_scores_recurrent(*inputs[:2], *factors)
        (scores * weights).sum().backward()
        gradients.append([x.grad for x in inputs])
    for fast, plain in zip(*gradients, strict=True):
        torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-5)


def saved_bytes(function) -> int:
    """Bytes autograd keeps for the backward of ``function()`` (each stored tensor once)."""
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return sum(saved.values())


def test_under_autograd_the_fast_form_keeps_far_less_than_the_recurrence():
    length, dim = 480, 8
    q, k, left, _ = random_case(length=length, dim=dim, shape=(1,))
    q, k, w = (x.requires_grad_() for x in (q, k, left.w))
    factors = Householders(w, left.beta)
    fast = saved_bytes(lambda: prepare_path(q, k, factors).scores(slice(0, length)))
    plain = saved_bytes(lambda: path_scores_recurrent(q, k, factors))
    assert plain >= 4 * length * length * dim  # the O(T^2 d) floats the spec warns of
    assert fast < plain / 8
    assert fast < 4 * 6 * length * BLOCK  # a few [T, C] maps


def test_the_prepared_state_grows_as_the_sequence_not_its_square():
    """What a layer keeps between row chunks: ``[T, C]`` in-block scores and ``[T, d]``-sized
    carried queries, keys and ``d x d`` block products, per head."""
    length, dim = 300, 8
    q, k, left, right = random_case(length=length, dim=dim, shape=(1,))
    prepared = prepare_path(q, k, left, right)
    kept = [prepared.local] + [
        tensor for side in prepared.sides for tensor in (side.queries, side.keys, side.transitions)
    ]
    blocks, size = 5, 60  # the fewest blocks of at most 64
    expected = blocks * size * (size + 4 * dim) + 2 * blocks * dim * dim
    assert sum(tensor.numel() for tensor in kept) == expected


class _Storages(TorchDispatchMode):
    """Records the bytes of every storage the operations inside write their results into."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.sizes[storage.data_ptr()] = storage.nbytes()
        return out


@pytest.mark.parametrize("bidirectional", [False, True])
def test_without_gradients_a_chunk_s_scores_are_one_map_with_the_bits_of_the_joined_form(
    bidirectional,
):
    """An evaluation's chunk writes each block's rows into one contiguous map over the keys
    (the softmax copies nothing, no map per block: their sizes fragmented the heap), with the
    bits of the form autograd takes (each block's product, joined, the padding cut), for one
    row, rows inside a block and rows across blocks. Three blocks of 44, two keys of padding."""
    torch.manual_seed(0)
    length = 130
    q, k = torch.randn(2, 2, 3, length, 4).unbind(0)
    factors = [random_factors((2, 3), length, 4) for _ in range(1 + bidirectional)]
    joined = prepare_path(q.clone().requires_grad_(), k, *factors, block=44)
    written = prepare_path(q, k, *factors, block=44)
    kept = [written.local, *(side.keys for side in written.sides), *(s.queries for s in written.sides)]
    prepared = {tensor.untyped_storage().data_ptr() for tensor in kept}
    for rows in (slice(0, length), slice(7, 8), slice(129, 130), slice(50, 54), slice(30, 100)):
        expected = joined.scores(rows).detach()
        with torch.no_grad(), _Storages() as storages:
            scores = written.scores(rows)
        assert torch.equal(scores, expected), rows
        assert scores.is_contiguous()
        map_bytes = 4 * 2 * 3 * (rows.stop - rows.start) * length
        room = -(-(rows.stop - rows.start - 1) // 44) + 1  # the most blocks the rows may span
        carried_keys = 4 * 2 * 3 * room * 132 * 4 * len(factors)
        made = [size for ptr, size in storages.sizes.items() if ptr not in prepared]
        large = [size for size in made if size >= map_bytes and size != carried_keys]
        if rows.stop - rows.start > 1:  # (one row goes through a map of its own)
            assert large == [map_bytes], (rows, made)


def test_every_chunk_of_as_many_rows_asks_for_maps_of_the_same_sizes():
    """Ten rows inside a block and ten across two blocks make maps of the same sizes (the
    carried keys have room for two blocks in both), which the allocator can reuse."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 3, 130, 4).unbind(0)
    prepared = prepare_path(q, k, random_factors((2, 3), 130, 4), block=44)
    sizes = []
    for rows in (slice(2, 12), slice(40, 50)):
        with torch.no_grad(), _Storages() as storages:
            prepared.scores(rows)
        sizes.append(sorted(size for size in storages.sizes.values() if size >= 20_000))
    assert sizes[0] == sizes[1] != []


def test_beta_two_is_a_reflection():
    """With beta = 2 the factor reflects w_1: a query along w_1 sees the key along w_1 negated,
    and two reflections in a row restore it."""
    w = torch.tensor([0.6, 0.8, 0.0])
    q = k = w.expand(1, 3, 3).clone()
    factors = Householders(w.expand(1, 3, 3), torch.tensor([[0.5, 2.0, 2.0]]))
    scores = prepare_path(q, k, factors).scores(slice(0, 3)) * math.sqrt(3)
    torch.testing.assert_close(scores[0, 1, 0], torch.tensor(-1.0))
    torch.testing.assert_close(scores[0, 2, 0], torch.tensor(1.0))
    torch.testing.assert_close(scores[0, 2, 1], torch.tensor(-1.0))


def test_beta_one_projects_out_w():
    w = torch.tensor([1.0, 0.0])
    factors = Householders(w.expand(1, 2, 2), torch.ones(1, 2))
    q = k = torch.tensor([[[1.0, 1.0], [1.0, 1.0]]])
    scores = prepare_path(q, k, factors).scores(slice(0, 2)) * math.sqrt(2)
    torch.testing.assert_close(scores, torch.tensor([[[2.0, 0.0], [1.0, 2.0]]]))


@pytest.mark.parametrize("bidirectional", [False, True])
def test_the_forget_bias_is_the_sum_of_log_gates_between_query_and_key(bidirectional):
    torch.manual_seed(0)
    log_f = F.logsigmoid(torch.randn(2, 7, dtype=torch.float64))
    log_f_right = F.logsigmoid(torch.randn(2, 7, dtype=torch.float64))
    expected = torch.zeros(2, 7, 7, dtype=torch.float64)
    for i in range(7):
        for j in range(7):
            if j <= i:
                expected[:, i, j] = log_f[:, j + 1 : i + 1].sum(-1)
            elif bidirectional:
                expected[:, i, j] = log_f_right[:, i:j].sum(-1)
    right = log_f_right if bidirectional else None
    for rows in CHUNKINGS["uneven"](7):
        bias = forget_bias(log_f, rows, right, scale=0.5)
        torch.testing.assert_close(bias, 0.5 * expected[:, rows], rtol=0, atol=1e-12)


def test_the_projections_give_unit_w_and_beta_in_range():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 16)
    for negative, high in ((True, 2.0), (False, 1.0)):
        torch.manual_seed(1)
        layer = PathProjections(2, 16, 4, negative_eigenvalues=negative, forget_gate=True)
        (w, beta), log_forget = layer(x)
        assert w.shape == (2, 3, 4, 6, 4) and beta.shape == log_forget.shape == (2, 3, 4, 6)
        # fla's epsilon dominates |w|^2 at che-bench's width and fla's small initial weights
        assert (w.norm(dim=-1) < 1).all()
        torch.testing.assert_close(beta, torch.full_like(beta, high / 2), rtol=0, atol=0.2)
        torch.testing.assert_close(
            log_forget, torch.full_like(beta, math.log(0.5)), atol=0.2, rtol=0
        )
        with torch.no_grad():
            layer.beta_proj.bias_parameter().fill_(30.0)  # sigmoid -> 1: the top of the range
        assert torch.allclose(layer(x).householders.beta, torch.tensor(high))
    weights = torch.cat([p.flatten() for n, p in layer.named_parameters() if "bias" not in n])
    assert abs(weights.std().item() - INIT_STD) < 0.003
    with torch.no_grad():
        layer.w_conv.weight.mul_(1000.0)
    norms = layer(x).householders.w.norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones(2, 3, 4, 6), rtol=0, atol=1e-3)


@pytest.mark.parametrize("anticausal", [False, True])
def test_w_reads_only_its_side_of_the_sequence(anticausal):
    torch.manual_seed(0)
    layer = PathProjections(1, 8, 2, anticausal=anticausal)
    x = torch.randn(1, 1, 9, 8, requires_grad=True)
    layer(x).householders.w[0, 0, :, 4].sum().backward()
    read = x.grad[0, 0].abs().sum(-1) > 0
    window = range(4, 4 + W_KERNEL) if anticausal else range(4 - W_KERNEL + 1, 5)
    assert read.nonzero().flatten().tolist() == list(window)


def test_each_member_computes_what_it_computes_alone():
    torch.manual_seed(0)
    alone = [PathProjections(1, 16, 4, forget_gate=True) for _ in range(3)]
    pack = load_member_states(PathProjections(3, 16, 4, forget_gate=True), alone)
    x = torch.randn(3, 2, 5, 16)
    together = pack(x)
    for member, layer in enumerate(alone):
        single = layer(x[member : member + 1])
        for a, b in zip(together.householders, single.householders, strict=True):
            torch.testing.assert_close(a[member : member + 1], b)
        torch.testing.assert_close(together.log_forget[member : member + 1], single.log_forget)


def fla_naive_path_attn():
    try:
        from fla.ops.path_attn.naive import naive_path_attn
    except Exception as error:  # not installed, or needing what this machine lacks
        pytest.skip(f"fla's naive PaTH reference does not import here: {error}")
    return naive_path_attn


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("with_gate", [False, True])
def test_outputs_match_fla_naive_reference(with_gate):
    """fla's ``naive_path_attn`` (chunks of 64, causal softmax over ``scale (q H k + D)``): the
    same outputs from che-bench's scores and forget bias scaled as fla's PaTH-FoX scales it."""
    naive_path_attn = fla_naive_path_attn()
    torch.manual_seed(0)
    batch, heads, length, dim = 2, 3, 70, 8
    q, k, v = torch.randn(3, batch, heads, length, dim).unbind(0)
    w, beta = random_factors((batch, heads), length, dim, low=1.5, high=2.0)
    log_f = torch.log(0.95 + 0.05 * torch.rand(batch, heads, length)) if with_gate else None
    scale = dim**-0.5
    logits = prepare_path(q, k, Householders(w, beta), block=16).scores(slice(0, length))
    if log_f is not None:
        logits = logits + forget_bias(log_f, slice(0, length), scale=scale)
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    ours = logits.masked_fill(future, float("-inf")).softmax(-1) @ v
    heads_last = [x.transpose(1, 2) for x in (q, k, v, w)]
    gate = torch.zeros(batch, heads, length) if log_f is None else log_f
    theirs = naive_path_attn(
        *heads_last, beta.transpose(1, 2), gate.transpose(1, 2), scale=scale
    ).transpose(1, 2)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
