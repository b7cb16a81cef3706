"""Properties of the positional encodings (hooks called as che_bench.model.encoder calls them)."""

from __future__ import annotations

import math

import pytest
import torch

from che_bench.encodings import (
    build_encoding,
    canonical_encoding_name,
    get_encoding_class,
    list_encodings,
)
from che_bench.encodings.alibi import alibi_slopes
from che_bench.encodings.t5 import t5_buckets
from che_bench.errors import CheBenchError

DIM, HEADS, LAYERS, TRAIN_TOKENS = 32, 4, 2, 120
HEAD_DIM = DIM // HEADS

ALL_NAMES = {
    "none", "sin_cos", "learned", "rope", "relative", "t5", "alibi", "kerple", "kerple_power",
    "fire", "cope", "random_sin_cos", "random_learned", "random_rope", "random_relative",
    "random_alibi", "fox", "stick_breaking", "path",
}
#: Attention-side encodings whose positional effect depends on i - j only.
TOEPLITZ = [
    "rope", "relative", "t5", "alibi", "kerple", "kerple_power", "random_relative", "random_alibi"
]
#: Encodings that must tell a key d tokens left of the query from one d tokens right.
BIDIRECTIONAL = TOEPLITZ + ["fire", "cope", "random_rope"]


def make(name: str, **options):
    torch.manual_seed(0)
    encoding = build_encoding(
        name, dim=DIM, heads=HEADS, layers=LAYERS, train_max_tokens=TRAIN_TOKENS, **options
    )
    if name == "cope":  # zero-initialised tables carry no position yet
        for hook in encoding.hooks:
            torch.nn.init.normal_(hook.left)
            torch.nn.init.normal_(hook.right)
    return encoding


def logits(hook, q, k, rows, ctx):
    """Scaled scores plus the additive bias, as the attention combines them."""
    scores = hook.scores(q, k, rows, ctx)
    bias = hook.bias(rows, k.shape[-2], ctx)
    return scores if bias is None else scores + bias


def constant_qk(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (different) q and k vector at every position: only positions vary.
    Shapes ``[M=1, B=1, H, T, d_h]``."""
    generator = torch.Generator().manual_seed(1)
    shape = (1, 1, HEADS, length, HEAD_DIM)
    q = torch.randn(1, 1, HEADS, 1, HEAD_DIM, generator=generator).expand(shape)
    k = torch.randn(1, 1, HEADS, 1, HEAD_DIM, generator=generator).expand(shape)
    return q.contiguous(), k.contiguous()


def generators(seed: int = 0) -> list[torch.Generator]:
    """One member's generator of random positions."""
    return [torch.Generator().manual_seed(seed)]


def full_logits(encoding, length: int, layer: int = 0, draws=None) -> torch.Tensor:
    """``[H, T, T]`` logits of one layer (with the given random sample, if any)."""
    hook = encoding.hooks[layer]
    q, k, ctx = hook.prepare(*constant_qk(length), None if draws is None else draws.layer(layer))
    return logits(hook, q, k, slice(0, length), ctx)[0, 0]


# --- registry ---------------------------------------------------------------------------


def test_registry_lists_every_encoding_with_metadata():
    classes = list_encodings()
    assert {cls.name for cls in classes} == ALL_NAMES
    for cls in classes:
        assert cls.description and "\n" not in cls.description
        assert cls.kind in ("none", "absolute", "relative")
    assert {c.name for c in classes if c.carries_bias} == {
        "t5", "alibi", "kerple", "kerple_power", "fire", "random_alibi", "fox"
    }
    randomized = {n for n in ALL_NAMES if n.startswith("random_")}
    assert {c.name for c in classes if c.randomized} == randomized


def test_aliases_and_normalisation():
    assert canonical_encoding_name("nope") == "none"
    assert canonical_encoding_name("NoPE") == "none"
    assert canonical_encoding_name("sin-cos") == "sin_cos"
    assert canonical_encoding_name("noisy_relative") == "random_relative"
    assert get_encoding_class("rotary").name == "rope"


def test_unknown_name_and_option_are_user_errors():
    with pytest.raises(CheBenchError, match="unknown positional encoding"):
        make("xpos")
    with pytest.raises(CheBenchError, match="does not take"):
        make("alibi", rope_base=10)
    with pytest.raises(CheBenchError):
        make("rope", rope_pairing="diagonal")


def test_options_are_resolved():
    assert make("fire").options()["fire_L0"] == TRAIN_TOKENS
    assert make("cope").options()["cope_npos"] == TRAIN_TOKENS + 1
    assert make("random_rope").options()["noise_max_length"] == 2048


# --- structure: Toeplitz, left/right, chunking, long sequences ----------------------------


@pytest.mark.parametrize("name", TOEPLITZ)
def test_positional_logits_depend_only_on_offset(name):
    length = 300
    encoding = make(name)
    draws = encoding.sample_draws(length, generators()) if encoding.randomized else None
    values = full_logits(encoding, length, draws=draws)
    # Shifting query and key by one leaves i - j, hence the logits, unchanged.
    torch.testing.assert_close(values[:, 1:, 1:], values[:, :-1, :-1], atol=1e-4, rtol=1e-4)


def test_toeplitz_check_detects_position_dependence():
    values = full_logits(make("fire", fire_L0=10), 300)  # rows beyond L0 are normalised by i
    assert not torch.allclose(values[:, 1:, 1:], values[:, :-1, :-1], atol=1e-4)


@pytest.mark.parametrize("name", BIDIRECTIONAL)
def test_left_and_right_keys_differ(name):
    encoding = make(name)
    draws = encoding.sample_draws(64, generators()) if encoding.randomized else None
    values = full_logits(encoding, 64, draws=draws)
    i = 32
    left = torch.stack([values[:, i, i - d] for d in range(1, 20)])
    right = torch.stack([values[:, i, i + d] for d in range(1, 20)])
    assert (left - right).abs().max() > 1e-3


def test_symmetric_alibi_cannot_tell_left_from_right():
    values = full_logits(make("alibi", alibi_mode="symmetric"), 64)
    torch.testing.assert_close(values, values.transpose(-1, -2))


# --- per-family facts ---------------------------------------------------------------------


def test_alibi_slopes():
    assert alibi_slopes(8) == [2.0**-h for h in range(1, 9)]
    twelve = [2.0**-h for h in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5]
    assert alibi_slopes(12) == pytest.approx(twelve)
    assert alibi_slopes(6) == pytest.approx([1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8])


def test_alibi_bias_values():
    distances = torch.arange(1.0, 10)[None]
    values = make("alibi").hooks[0].bias(slice(0, 10), 10, (distances, distances))[0, 0]
    slope = alibi_slopes(HEADS)[0]
    assert values[0, 5, 5] == 0
    assert values[0, 5, 8] == pytest.approx(-3 * slope)  # key 3 to the right
    assert values[0, 5, 2] == pytest.approx(-2.5 * slope)  # key 3 to the left


def test_t5_bucket_examples():
    examples = {
        -1: 1, -7: 7, -8: 8, -9: 8, -16: 10, -32: 12, -64: 14, -127: 15, -1000: 15,
        0: 0, 1: 17, 8: 24, 16: 26, 64: 30, 127: 31, 1000: 31,
    }
    relative = torch.tensor(list(examples))
    assert t5_buckets(relative, 32, 128).tolist() == list(examples.values())


def test_t5_table_is_shared_by_layers():
    encoding = make("t5")
    assert encoding.hooks[0] is encoding.hooks[1]
    assert sum(p.numel() for p in encoding.parameters()) == 32 * HEADS


def test_kerple_parameters_stay_positive_after_a_harmful_step():
    for name in ("kerple", "kerple_power"):
        encoding = make(name)
        hook = encoding.hooks[0]
        optimizer = torch.optim.SGD(encoding.parameters(), lr=100.0)
        q, k, ctx = hook.prepare(*constant_qk(16))
        # Gradient of -sum(bias) w.r.t. r1 and r2 is positive: the step drives them negative.
        (-hook.bias(slice(0, 16), 16, ctx).sum()).backward()
        optimizer.step()
        assert (hook.r1 < 0).any() and (hook.r2 < 0).any()
        encoding.project_()
        assert (hook.r1 >= 0.01).all() and (hook.r2 >= 0.01).all()
        if name == "kerple_power":
            assert (hook.r2 <= 2).all()


def test_kerple_projects_in_forward_and_survives_layer_sharing():
    encoding = make("kerple_power", share_across_layers=True)  # pow saves r2 for backward
    hook = encoding.hooks[0]
    assert encoding.hooks[1] is hook
    with torch.no_grad():
        hook.r1.fill_(-1.0)
    total = 0
    for layer in encoding.hooks:  # the second prepare must not break the first layer's graph
        q, k, ctx = layer.prepare(*constant_qk(8))
        total = total + layer.bias(slice(0, 8), 8, ctx).sum()
    total.backward()
    assert (hook.r1 >= 0.01).all() and hook.r1.grad is not None


def causal_fire(hook, length: int) -> torch.Tensor:
    """The published (causal) FIRE bias, written out from the paper's formula."""
    i = torch.arange(length, dtype=torch.float32)[:, None]
    j = torch.arange(length, dtype=torch.float32)[None, :]
    c = hook.c.abs()  # one member
    threshold = (hook.lam * hook.l0).abs()
    u = torch.log(c * (i - j) + 1) / (torch.log(c * torch.maximum(threshold, i) + 1) + 1e-6)
    return hook.mlp(u[None, ..., None])[0].permute(2, 0, 1)


def test_fire_left_half_is_causal_fire():
    length = 200  # beyond L0 = 120, so the normaliser varies with the row
    hook = make("fire").hooks[0]
    bias = hook.bias(slice(0, length), length, None)[0, 0]
    reference = causal_fire(hook, length)
    left = torch.ones(length, length, dtype=torch.bool).tril()
    torch.testing.assert_close(bias[:, left], reference[:, left])


def test_fire_coordinate_is_normalised_per_side():
    length = 300  # beyond L0 = 120
    u = make("fire").hooks[0].relative_coordinate(slice(0, length), length)[0]
    assert u.abs().max() <= 1
    # Mirroring the sequence swaps the sides: the right side is normalised by its own keys.
    torch.testing.assert_close(u, -u.flip(0, 1))


def test_fire_is_finite_at_row_zero_and_far_beyond_training():
    hook = make("fire").hooks[0]
    with torch.no_grad():
        hook.lam.fill_(0.0)  # degenerate threshold: the clamp must keep row 0 finite
        hook.c.fill_(0.0)
        for rows in (slice(0, 2), slice(3998, 4000)):
            assert torch.isfinite(hook.bias(rows, 4000, None)).all()


def test_fire_eval_cache_follows_parameter_updates():
    hook = make("fire").hooks[0]
    with torch.no_grad():
        first = hook.bias(slice(0, 10), 10, None)
        assert hook.bias(slice(0, 10), 10, None) is first  # cached
        hook.c.add_(1.0)  # what an optimizer step does
        updated = hook.bias(slice(0, 10), 10, None)
    assert not torch.allclose(updated, first)
    torch.testing.assert_close(updated, hook.bias(slice(0, 10), 10, None))


def test_relative_one_hot_offset_lands_on_its_diagonal():
    hook = make("relative").hooks[0]
    length = 6
    q = torch.zeros(1, 1, HEADS, length, HEAD_DIM)
    k = torch.zeros(1, 1, HEADS, length, HEAD_DIM)
    with torch.no_grad():
        hook.v.fill_(1.0)
        for offset in (0, 1, -2):  # offset = j - i
            table = torch.zeros(1, HEADS, 2 * length - 1, HEAD_DIM)
            table[:, :, offset + length - 1] = 1.0  # a one-hot r at this offset only
            scores = hook.scores(q, k, slice(0, length), table)[0, 0, 0]
            expected = torch.diag(torch.ones(length - abs(offset)), diagonal=offset)
            torch.testing.assert_close(scores, expected * HEAD_DIM / math.sqrt(HEAD_DIM))


def test_cope_counts_gates_from_the_query_to_the_key_on_each_side():
    npos, length = 8, 20
    hook = make("cope", cope_npos=npos).hooks[0]
    q = torch.randn(1, 1, HEADS, 1, HEAD_DIM).expand(1, 1, HEADS, length, HEAD_DIM)
    k = torch.zeros(1, 1, HEADS, length, HEAD_DIM)  # zero content: every gate is sigmoid(0) = 1/2
    direction = q[0, 0, 0, 0] / q[0, 0, 0, 0].square().sum()
    with torch.no_grad():  # table logits q . e[n]: n on the left, 100 + n on the right
        hook.left.copy_(direction[:, None] * torch.arange(npos))
        hook.right.copy_(direction[:, None] * (100 + torch.arange(npos)))
        scores = hook.scores(q, k, slice(0, length), None)[0, 0, 0] * math.sqrt(HEAD_DIM)
    i = 10
    for d in range(6):
        count = min(0.5 * (d + 1), npos - 1)  # the query itself and the d keys between
        assert scores[i, i - d] == pytest.approx(count, abs=1e-4)
        if d:
            assert scores[i, i + d] == pytest.approx(100 + count, abs=1e-4)
    assert scores[0, length - 1] == pytest.approx(100 + npos - 1, abs=1e-4)  # saturated


def test_rope_frequencies_and_norm_preservation():
    hook = make("rope").hooks[0]
    torch.testing.assert_close(hook.theta, torch.tensor([1.0, 0.1, 0.01, 0.001][: HEAD_DIM // 2]))
    for pairing in ("interleaved", "half"):
        hook = make("rope", rope_pairing=pairing).hooks[0]
        q = torch.randn(1, 1, HEADS, 50, HEAD_DIM)
        rotated, _, _ = hook.prepare(q, q)
        torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))
        torch.testing.assert_close(rotated[..., 0, :], q[..., 0, :])  # position 0: no rotation


def test_sin_cos_positions_and_backward_option():
    length = 7
    zeros = lambda length: torch.zeros(1, 1, length, DIM)  # noqa: E731
    forward = make("sin_cos").embed(zeros(length))[0, 0]
    backward = make("sin_cos", sin_cos_backward=True).embed(zeros(length))[0, 0]
    torch.testing.assert_close(forward[0], torch.cat([torch.zeros(DIM // 2), torch.ones(DIM // 2)]))
    torch.testing.assert_close(backward[-1], forward[1])  # last token at position 1
    torch.testing.assert_close(backward[0], make("sin_cos").embed(zeros(8))[0, 0, 7])


def test_learned_table_errors_past_its_end():
    encoding = make("learned", max_positions=50)
    assert encoding.embed(torch.zeros(1, 1, 50, DIM)).shape == (1, 1, 50, DIM)
    with pytest.raises(CheBenchError, match="max_positions"):
        encoding.embed(torch.zeros(1, 1, 51, DIM))


# --- randomized encodings -----------------------------------------------------------------


def drawn_positions(encoding, draws, length: int) -> torch.Tensor:
    """The positions (or, for offset sampling, right-side distances) of one member's draw."""
    name = encoding.name
    if name in ("random_sin_cos", "random_learned"):
        return draws.embedding[0]
    if name == "random_rope":
        return draws.layer(0)[0]
    if name == "random_alibi":
        return draws.layer(0)[1][0]
    hook = encoding.hooks[0]
    return hook.offset_positions(length, torch.device("cpu"), draws.layer(0))[0, length:]


RANDOMIZED = ["random_sin_cos", "random_learned", "random_rope", "random_relative", "random_alibi"]


@pytest.mark.parametrize("name", RANDOMIZED)
def test_random_draws_are_sorted_distinct_and_in_range(name):
    encoding = make(name, noise_max_length=64)
    pack = generators(0)
    for _ in range(20):
        drawn = drawn_positions(encoding, encoding.sample_draws(40, pack), 40)
        assert (drawn[1:] > drawn[:-1]).all()  # sorted and distinct
        assert drawn.min() >= 0 and drawn.max() < 64
    assert not torch.equal(*(drawn_positions(encoding, encoding.sample_draws(40, pack), 40)
                             for _ in range(2)))


@pytest.mark.parametrize("name", RANDOMIZED)
def test_each_member_draws_from_its_own_generator(name):
    encoding = make(name, noise_max_length=64)
    both = _tensors(encoding.sample_draws(40, generators(0) + generators(1)))
    alone = [_tensors(encoding.sample_draws(40, generators(seed))) for seed in (0, 1)]
    for member in (0, 1):
        for packed, single in zip(both, alone[member]):
            assert torch.equal(packed[member], single[0])


def _tensors(draws) -> list[torch.Tensor]:
    """Every tensor of a sample, ``[M, ...]`` each."""
    items = [draws.embedding] if draws.embedding is not None else []
    for item in draws.layers or []:
        items.extend(item if isinstance(item, tuple) else [item])
    return items


def embedding_or_logits(encoding, length: int, draws=None) -> torch.Tensor:
    if encoding.kind == "absolute":
        return encoding.embed(torch.zeros(1, 1, length, DIM), draws)
    return full_logits(encoding, length, draws=draws)


@pytest.mark.parametrize("name", RANDOMIZED)
def test_random_outputs_differ_between_calls_and_reproduce_under_seed(name):
    encoding = make(name)
    pack = generators(5)
    first = embedding_or_logits(encoding, 30, encoding.sample_draws(30, pack))
    second = embedding_or_logits(encoding, 30, encoding.sample_draws(30, pack))
    assert not torch.allclose(first, second)
    again = embedding_or_logits(encoding, 30, encoding.sample_draws(30, generators(5)))
    torch.testing.assert_close(again, first)


@pytest.mark.parametrize("name", RANDOMIZED)
def test_randomize_at_eval_switch(name):
    length = 30
    plain_name = {"random_learned": "learned", "random_sin_cos": "sin_cos"}.get(name, name[7:])
    fixed = make(name, randomize_at_eval=False)
    assert fixed.draws_active(evaluating=False) and not fixed.draws_active(evaluating=True)
    # Same seed, same parameters: without a draw it is the plain encoding.
    plain = embedding_or_logits(make(plain_name), length)
    torch.testing.assert_close(embedding_or_logits(fixed, length), plain)
    default = make(name)  # the reference samples at evaluation too
    assert default.draws_active(evaluating=True)


def test_random_relative_mirrors_left_offsets_and_reference_bug_mode():
    length = 10
    encoding = make("random_relative")
    draw = encoding.sample_draws(length, generators()).layer(0)
    values = encoding.hooks[0].offset_positions(length, torch.device("cpu"), draw)[0]
    torch.testing.assert_close(values[: length - 1].flip(0), -values[length:])
    assert values[length - 1] == 0
    bug = make("random_relative", relative_reference_bug=True, noise_max_length=100)
    draw = bug.sample_draws(length, generators()).layer(0)
    values = bug.hooks[0].offset_positions(length, torch.device("cpu"), draw)[0]
    assert (values[length - 1 :] == 99).all()  # every key at or right of the query
    assert (values[: length - 1] < 100).all() and (values[: length - 1] > 0).all()


def test_random_draws_shared_across_layers_when_asked():
    per_layer, shared = make("random_alibi"), make("random_alibi", random_per_layer=False)
    for encoding, same in ((per_layer, False), (shared, True)):
        draws = encoding.sample_draws(20, generators())
        first, second = (full_logits(encoding, 20, layer, draws) for layer in (0, 1))
        assert torch.allclose(first, second) == same


def test_sequence_longer_than_the_random_range_is_a_user_error():
    for name in ("random_sin_cos", "random_rope"):
        with pytest.raises(CheBenchError, match="noise_max_length"):
            make(name, noise_max_length=100).sample_draws(101, generators())


def test_an_option_of_the_encoding_none_is_refused_without_naming_none_as_an_option():
    """The default encoding is named none: "its options: none" would read as an option."""
    with pytest.raises(CheBenchError) as refused:
        build_encoding("none", dim=8, heads=2, layers=1, train_max_tokens=8, foo=1)
    assert str(refused.value) == "encoding 'none' does not take option(s) foo; it takes no options"
