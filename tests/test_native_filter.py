"""DAPE's native filter (``che_bench.model.dape.native``, issue 28): the compiled kernel
against a plain conv1d form of f and torch's softmax at the model's shapes and odd ones, on
one thread and several, its switch, its fallback without a compiler, its cache, and its record
in a run's software (fixtures ``native_kernel`` and ``filter_implementation``: tests/conftest.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from che_bench import cpu, native_build
from che_bench.cli import main
from che_bench.config import make_config
from che_bench.model.dape import native
from che_bench.run.provenance import software_versions
from che_bench.store import ResultStore

def reference(scores, content, residual, addend, weights, softmax=False, first_row=None):
    """``scores + residual + f(content)``, f as two conv1d along the keys, then the masked
    softmax when asked."""
    batch, heads, rows, length = scores.shape
    weight1, weight2 = weights
    pad = weight1.shape[-1] // 2
    flat = content.permute(0, 2, 1, 3).reshape(batch * rows, heads, length)
    hidden = F.conv1d(flat, weight1, padding=pad).view(batch, rows, -1, length)
    hidden = F.leaky_relu(hidden + addend.transpose(0, 1), 0.01).flatten(0, 1)
    filtered = F.conv1d(hidden, weight2, padding=pad).view(batch, rows, heads, length)
    logits = scores + residual + filtered.transpose(1, 2)
    if not softmax:
        return logits
    if first_row is not None:
        query = first_row + torch.arange(rows)[:, None]
        logits = logits.masked_fill(torch.arange(length) > query, -torch.inf)
    return torch.softmax(logits, -1)


def case(heads, width, size, rows, length, broadcast, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator) * scale

    scores = draw(2, heads, rows, length)
    residual = draw(heads, 1, 1) if broadcast else draw(heads, rows, length)
    addend = draw(width, 1, 1) if broadcast else draw(width, rows, length)
    weights = draw(width, heads, size, scale=0.3), draw(heads, width, size, scale=0.3)
    return scores, residual, addend, weights


SHAPES = [(8, 32), (3, 5), (16, 16), (12, 20)]  # the model's; remainders of a register block


@pytest.mark.parametrize("heads, width", SHAPES)
@pytest.mark.parametrize("size", [1, 3, 5, 7])
@pytest.mark.parametrize("length", [1, 5, 16, 53, 501])
@pytest.mark.parametrize("broadcast", [False, True])
def test_the_kernel_gives_f_s_logits(heads, width, size, length, broadcast, native_kernel):
    scores, residual, addend, weights = case(heads, width, size, 3, length, broadcast)
    content = scores.clone()
    ours = scores.clone()
    native_kernel.add(ours, ours, residual, addend, native.Convolutions.of(*weights))
    expected = reference(scores, content, residual, addend, weights)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("first_row", [None, 0, 4, 600])
@pytest.mark.parametrize("length", [1, 16, 53, 501])
@pytest.mark.parametrize("scale", [0.1, 30.0])
def test_the_kernel_gives_the_attention_s_probabilities(first_row, length, scale, native_kernel):
    scores, residual, addend, weights = case(8, 32, 3, 5, length, False, seed=1)
    scores *= scale
    if scale > 1:  # exp over a wide range: f off, so the logits carry no rounding to amplify
        weights = tuple(torch.zeros_like(weight) for weight in weights)
    ours = scores.clone()
    laid_out = native.Convolutions.of(*weights)
    native_kernel.add(ours, scores, residual, addend, laid_out, True, first_row)
    expected = reference(scores, scores, residual, addend, weights, True, first_row)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)
    if first_row is not None:  # keys after the query: exactly 0
        hidden = torch.arange(length) > first_row + torch.arange(5)[:, None]
        assert not ours[..., hidden].any()


def test_the_switch_turns_it_off_without_compiling(monkeypatch):
    monkeypatch.setenv(native.SWITCH, "0")
    monkeypatch.setattr(native_build, "compile_library", lambda *arguments: pytest.fail("compiled"))
    native.native_filter.cache_clear()
    try:
        assert native.native_filter() is None
        assert native.describe() == "chunks"
    finally:
        native.native_filter.cache_clear()


def test_the_portable_mode_turns_it_off():
    assert cpu.PORTABLE_ENVIRONMENT[native.SWITCH] == "0"


@pytest.mark.parametrize("compiler, warns", [("no-such-compiler", False), ("false", True)])
def test_without_a_compiler_evaluation_keeps_the_chunks_filter(monkeypatch, tmp_path,
                                                              compiler, warns):
    monkeypatch.setenv(native.SWITCH, "1")
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.native_filter.cache_clear()
    try:
        if warns:
            with pytest.warns(UserWarning, match="did not compile"):
                assert native.native_filter() is None
        else:
            assert native.native_filter() is None
    finally:
        native.native_filter.cache_clear()


def test_the_library_is_built_once_per_cpu_and_compiler(monkeypatch, tmp_path, native_kernel):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.native_filter.cache_clear()
    built = native.native_filter()
    assert built is not None and "-march=native" in built.description
    assert len(list((tmp_path / "che-bench").glob("fused_filter-*.so"))) == 1
    native.native_filter.cache_clear()
    monkeypatch.setattr(
        native_build, "compile_library", lambda *arguments: pytest.fail("compiled again")
    )
    assert native.native_filter().description == built.description


def test_a_dape_run_records_how_its_filter_evaluates(filter_implementation):
    cpu = torch.device("cpu")
    recorded = software_versions(make_config("parity_check", "kerple", 3, "smoke"), cpu)
    assert recorded["dape_filter"].startswith(filter_implementation)
    no_dape = make_config("parity_check", "kerple", None, "smoke")
    assert "dape_filter" not in software_versions(no_dape, cpu)


def test_a_run_and_its_re_evaluation_record_the_filter_of_their_device(tmp_path, capsys):
    """``execute_pack`` and ``evaluate`` pass the device they ran on to the record."""
    store = ["--store", str(tmp_path / "s.sqlite"), "--no-progress", "--device", "cpu"]
    assert main(["run", "--task", "parity_check", "--pe", "kerple", "--kernel", "3",
                 "--preset", "smoke", "--steps", "2", "--test-lengths", "41",
                 "--eval-samples", "2", "--eval-batch-size", "2", *store]) == 0  # fmt: skip
    run_id = ResultStore(store[1]).runs()["run_id"][0]
    assert main(["evaluate", run_id, "--test-lengths", "42", *store]) == 0
    evaluations = ResultStore(store[1]).evaluations([run_id])
    assert len(evaluations) == 2 and all(
        "dape_filter" in json.loads(versions) for versions in evaluations["versions"]
    )
    capsys.readouterr()


def test_a_gpu_dape_run_records_the_convolutions_and_compiles_nothing(monkeypatch):
    """Issue 44: a GPU run compiled the CPU kernel for its record and recorded "native (...;
    trains DAPE V2)"; on a GPU the grouped convolutions run. A run of unknown device records
    no filter."""
    monkeypatch.setattr(native, "native_filter", lambda: pytest.fail("compiled for a GPU run"))
    config = make_config("parity_check", "kerple", 3, "smoke")
    assert software_versions(config, torch.device("cuda"))["dape_filter"] == "convolution"
    assert "dape_filter" not in software_versions(config)


@pytest.mark.parametrize("batch, causal", [(1, True), (2, False), (5, True)])
def test_several_threads_give_one_thread_s_numbers(batch, causal, native_kernel):
    """Parts of a tile by sequence (5 of them) or by row (1 or 2 on 4 threads), bit for bit."""
    scores, residual, addend, weights = case(8, 32, 3, 7, 53, False, seed=2)
    scores = scores[:1].expand(batch, -1, -1, -1).contiguous()
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 4):
            torch.set_num_threads(count)
            ours = scores.clone()
            laid_out = native.Convolutions.of(*weights)
            native_kernel.add(ours, ours, residual, addend, laid_out, True, 3 if causal else None)
            results.append(ours)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*results)
    expected = reference(scores, scores, residual, addend, weights, True, 3 if causal else None)
    torch.testing.assert_close(results[1], expected, atol=1e-6, rtol=1e-5)


def test_a_cached_library_that_does_not_load_is_built_again(monkeypatch, tmp_path,
                                                           native_kernel):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = shutil.which(os.environ.get("CC", "cc"))
    version = native_build.compiler_version(compiler)
    cached = native_build.cached_library(native.SOURCE, compiler, version, native_build.flag_sets()[0])
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"an interrupted build")
    native.native_filter.cache_clear()
    assert native.native_filter() is not None
    assert cached.read_bytes().startswith(b"\x7fELF")
