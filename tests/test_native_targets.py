"""The instruction sets the native kernels are built for (``che_bench.native_build``, issue 48):
``$CHE_BENCH_NATIVE_MARCH`` picks the target; a target the compiler refuses (an unknown CPU,
``-march=native`` on a compiler that cannot tell) falls back to its default target with a
one-line warning; DAPE's filter built for AVX2 (``x86-64-v3``) gives f's numbers, and its
logits are the AVX-512 build's bit for bit; the C sources build for AArch64 where a cross
compiler is found, and DAPE's filter built for it gives x86's logits, bit for bit, under qemu;
the FMA loop's vectors are as wide as the kernel's."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from che_bench import native_build
from che_bench.model.dape import native
from tests import test_native_filter as kernel_tests  # a module: its tests run once, there
from tests.test_dape_native_training import filter_and_gradients

ROOT = Path(__file__).resolve().parents[1]
#: Built for AArch64 by a test each (DAPE's filter, with its check under qemu, by another).
SOURCES = [ROOT / "che_bench/model/state_tracking/delta_rule_native.c",
           ROOT / "benchmarks/fma_peak.c"]


def built_for(monkeypatch, target: str | None) -> native.NativeFilter:
    """DAPE's filter built afresh for ``target`` (None: this CPU's)."""
    if target is None:
        monkeypatch.delenv(native_build.TARGET_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(native_build.TARGET_VARIABLE, target)
    native.native_filter.cache_clear()
    kernel = native.native_filter()
    assert kernel is not None
    return kernel


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture
def avx2_kernel(monkeypatch, native_kernel):
    """DAPE's filter built for ``x86-64-v3`` (AVX2 and FMA, no AVX-512), where this CPU runs
    it and the compiler knows the target."""
    if not {"avx2", "fma"} <= _cpu_flags() or not Path("/proc/cpuinfo").exists():
        pytest.skip("this CPU has no AVX2 and FMA")
    kernel = built_for(monkeypatch, "x86-64-v3")
    if "x86-64-v3" not in kernel.description:
        pytest.skip(f"the compiler does not know x86-64-v3 ({kernel.description})")
    yield kernel
    native.native_filter.cache_clear()


def test_a_refused_target_builds_for_the_default_target_with_a_warning(monkeypatch, tmp_path,
                                                                      native_kernel):
    """What a compiler that cannot build for ``-march=native`` (or an unknown target) does:
    the compiler's default target, one warning line that says so, the same f."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.warns(UserWarning, match="built for the compiler's default target") as caught:
        kernel = built_for(monkeypatch, "no-such-cpu")
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert "-march=no-such-cpu" in str(caught[0].message)
    assert "default target" in kernel.description and "-march" not in kernel.description
    kernel_tests.test_the_kernel_gives_f_s_logits(8, 32, 3, 53, False, kernel)
    native.native_filter.cache_clear()


@pytest.mark.parametrize("heads, width", [(8, 32), (3, 5), (12, 20)])
@pytest.mark.parametrize("size", [3, 7])
@pytest.mark.parametrize("length", [5, 53, 501])
def test_the_avx2_build_gives_f_s_logits(heads, width, size, length, avx2_kernel):
    assert avx2_kernel.lanes == 8 and "AVX2" in avx2_kernel.description
    kernel_tests.test_the_kernel_gives_f_s_logits(heads, width, size, length, False, avx2_kernel)


@pytest.mark.parametrize("first_row", [None, 4])
def test_the_avx2_build_gives_the_attention_s_probabilities(first_row, avx2_kernel):
    probabilities = kernel_tests.test_the_kernel_gives_the_attention_s_probabilities
    probabilities(first_row, 53, 0.1, avx2_kernel)


@pytest.mark.parametrize("kernel", [3, 7])
@pytest.mark.parametrize("shape", [(5, 8, 41, 41), (1, 8, 2, 100)])
def test_the_avx2_build_trains_as_the_chunks_do(kernel, shape, avx2_kernel, monkeypatch):
    """Logits and every gradient within float32 rounding of the chunks' arithmetic."""
    from che_bench.model.dape import score_filter

    ours = filter_and_gradients(kernel, "concat_residual", True, False, 1, shape)
    monkeypatch.setattr(score_filter, "training_kernel", lambda kernel: None)
    theirs = filter_and_gradients(kernel, "concat_residual", True, False, 1, shape)
    for mine, expected in zip(ours, theirs, strict=True):
        assert (mine - expected).abs().max() <= 1e-5 * expected.abs().max().clamp_min(1e-12)


def test_the_avx2_build_s_logits_are_this_cpu_s_build_s_bit_for_bit(avx2_kernel, monkeypatch):
    """Each logit sums its products in one order, with fused multiply-adds, whatever the
    vector width: evaluation's logits do not depend on the build (the softmax's sums over
    the keys, and the weights' gradients, go lane by lane: those differ in their last bits)."""
    scores, residual, addend, weights = kernel_tests.case(8, 32, 3, 5, 501, False, seed=4)
    outputs = []
    for kernel in (avx2_kernel, built_for(monkeypatch, None)):
        logits = scores.clone()
        kernel.add(logits, logits, residual, addend, native.Convolutions.of(*weights))
        outputs.append(logits)
    assert torch.equal(*outputs)


@pytest.mark.parametrize("source", SOURCES, ids=lambda path: path.name)
def test_the_kernels_build_for_aarch64(source, tmp_path):
    """Where a cross compiler is installed (``apt-get install gcc-aarch64-linux-gnu``): the
    sources build for AArch64's default target with the flags che-bench uses (the delta
    rule's 8-float vectors took the compiler minutes there)."""
    compiler = shutil.which("aarch64-linux-gnu-gcc")
    if compiler is None:
        pytest.skip("no aarch64-linux-gnu-gcc")
    command = [compiler, *native_build.COMMON_FLAGS, str(source), "-o", str(tmp_path / "k.so")]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def harness_output(command: list[str], tmp_path: Path, *runner: str) -> str:
    """What ``fused_filter_harness.c``, built by ``command`` (a compiler and its target),
    prints when run (by ``runner``, an emulator, when given)."""
    program = tmp_path / "harness"
    flags = ["-O3", "-std=gnu11", "-Wno-psabi", "-I", str(native.SOURCE.parent)]
    build = [*command, *flags, str(Path(__file__).with_name("fused_filter_harness.c")),
             "-o", str(program), "-lm"]
    subprocess.run(build, check=True, capture_output=True)
    return subprocess.run([*runner, str(program)], check=True, capture_output=True,
                          text=True).stdout


def test_the_aarch64_build_gives_f_s_logits_bit_for_bit_as_x86_s(tmp_path, native_kernel):
    """Where a cross compiler and qemu are installed (``apt-get install gcc-aarch64-linux-gnu
    qemu-user``): the AArch64 build, run under qemu, gives f's logits within float32 rounding
    of f in double precision, and the same bits as this CPU's build (both with fused
    multiply-adds, each logit's products in one order). fused_filter.c did not compile for
    AArch64 before issue 48 (an x86-only register constraint)."""
    cross, emulator = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cross is None or emulator is None:
        pytest.skip("no aarch64-linux-gnu-gcc and qemu-aarch64")
    compiler = shutil.which(os.environ.get("CC", "cc"))
    ours = harness_output([compiler, "-march=native"], tmp_path)
    arm = harness_output([cross, "-static"], tmp_path, emulator)
    assert arm.startswith("AArch64 NEON, 4 lanes: largest error ")
    assert float(arm.split("largest error ")[1].split(",")[0]) < 1e-5
    assert arm.split("hash ")[1] == ours.split("hash ")[1]


def test_the_fma_loop_s_vectors_are_the_kernel_s(monkeypatch, avx2_kernel):
    """Built for the same target, the FMA loop's vectors are as wide as the filter's (a loop
    of vectors wider than the registers measures memory, not the FMA units)."""

    def declare(library: ctypes.CDLL) -> None:
        library.fma_peak_flops.argtypes = [ctypes.c_long]
        library.fma_peak_flops.restype = ctypes.c_double

    for target in ("x86-64-v3", None):
        kernel = built_for(monkeypatch, target)
        built = native_build.build(SOURCES[1], declare)
        assert built is not None and built.library.fma_peak_lanes() == kernel.lanes
        assert built.library.fma_peak_flops(3) % (2 * 3 * kernel.lanes) == 0
