"""Small C kernels compiled on first use (DAPE's native filter, the delta rule's native
recurrence): the system's C compiler (``$CC``, else ``cc``) builds a source file for this CPU
(``-march=native``, or the target ``$CHE_BENCH_NATIVE_MARCH`` names; for the compiler's
default target, with a warning, where it refuses the flag), and ``ctypes`` loads the
library, releasing the GIL during each call, so a kernel's parts can run on several threads.
Libraries are cached under ``$XDG_CACHE_HOME/che-bench`` (``~/.cache/che-bench``), keyed by
the source, the compiler, its flags and the CPU.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

#: The environment variable naming the instruction sets the kernels are built for, as
#: ``-march=`` takes them: unset, ``native`` (this CPU's); ``x86-64-v3`` builds for AVX2 and FMA
#: without AVX-512 (how the AVX2 path is measured on an AVX-512 CPU).
TARGET_VARIABLE = "CHE_BENCH_NATIVE_MARCH"
COMMON_FLAGS = ("-O3", "-std=gnu11", "-shared", "-fPIC", "-Wno-psabi")
Part = TypeVar("Part")


def flag_sets() -> tuple[tuple[str, ...], ...]:
    """Flag sets tried in order: the target's instruction sets (``$CHE_BENCH_NATIVE_MARCH``,
    default this CPU's), then the compiler's default target."""
    return ((f"-march={os.environ.get(TARGET_VARIABLE) or 'native'}",), ())


class NativeBuildError(Exception):
    """A compiler was found but built no library that loads (the last reason)."""


@dataclass(frozen=True)
class Built:
    """A loaded library and what built it (``description``: compiler and flags); ``refused``:
    why the target's flags built nothing, when the compiler's default target built it."""

    library: ctypes.CDLL
    description: str
    refused: str | None = None


def switched_build(
    source: Path, declare: Callable[[ctypes.CDLL], None], switch: str, what: str, instead: str
) -> Built | None:
    """``build``, unless the environment variable ``switch`` is "0"; a compiler that builds
    nothing gives a warning that ``what`` did not compile and ``instead`` runs, and None; one
    that builds it only for its default target, a warning that says so."""
    if os.environ.get(switch, "1") == "0" or not source.exists():
        return None
    try:
        built = build(source, declare)
    except NativeBuildError as error:
        warnings.warn(
            f"{what} did not compile ({error}); {instead} (set {switch}=0 to skip the attempt)",
            stacklevel=3,
        )
        return None
    if built is not None and built.refused is not None:
        warnings.warn(
            f"{what} built for the compiler's default target, slower: {built.refused}",
            stacklevel=3,
        )
    return built


def build(source: Path, declare: Callable[[ctypes.CDLL], None]) -> Built | None:
    """``source`` compiled (or taken from the cache) and loaded, its functions typed by
    ``declare``; None without a compiler; NativeBuildError if no flag set builds it."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    version = compiler_version(compiler)
    errors: list[str] = []
    for flags in flag_sets():
        path = cached_library(source, compiler, version, flags)
        error = None if path.exists() else compile_library(source, compiler, flags, path)
        library = load(path, declare) if error is None else None
        if library is None and error is None:  # a cached library that does not load
            error = compile_library(source, compiler, flags, path)
            library = load(path, declare) if error is None else None
        if library is not None:
            refused = f"{' '.join(flag_sets()[0])}: {errors[0]}" if errors else None
            return Built(library, f"{version} {' '.join(flags) or 'default target'}", refused)
        errors.append(error or f"{path} does not load")
    raise NativeBuildError(errors[-1])


def load(path: Path, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    try:
        library = ctypes.CDLL(str(path))
    except OSError:
        return None
    declare(library)
    return library


def compiler_version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    lines = result.stdout.splitlines()
    return lines[0].strip() if lines else Path(compiler).name


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's flags on Linux, else its name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def cached_library(source: Path, compiler: str, version: str, flags: tuple[str, ...]) -> Path:
    key = "\n".join([source.read_text(), compiler, version, *COMMON_FLAGS, *flags])
    if flags:
        key += "\n" + _cpu_identity()
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "che-bench"
    return cache / f"{source.stem}-{digest}.so"


def compile_library(source: Path, compiler: str, flags: tuple[str, ...], path: Path) -> str | None:
    """Build the library at ``path`` (atomically: workers may race); the compiler's first
    error line if it fails."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
            built = Path(scratch) / path.name
            command = [compiler, *COMMON_FLAGS, *flags, str(source), "-o", str(built)]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                lines = [line for line in result.stderr.splitlines() if "error" in line]
                return (lines or result.stderr.splitlines() or ["no output"])[0].strip()
            os.replace(built, path)
    except OSError as error:
        return str(error)
    return None


def split(size: int, parts: int) -> list[slice]:
    """``range(size)`` in at most ``parts`` contiguous, non-empty slices of near-equal size."""
    bounds = [size * part // parts for part in range(parts + 1)]
    return [slice(start, stop) for start, stop in itertools.pairwise(bounds) if stop > start]


@functools.cache
def _executor(threads: int) -> ThreadPoolExecutor:
    """Threads for a kernel's parts (ctypes releases the GIL during each call)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="che-bench-native")


def run_parts(call: Callable[[Part], None], parts: Sequence[Part]) -> None:
    """``call(part)`` for every part: in this thread when there is one, else each on a thread
    of its own (ctypes releases the GIL during each kernel call), waiting for all."""
    if len(parts) == 1:
        call(parts[0])
        return
    for job in [_executor(len(parts)).submit(call, part) for part in parts]:
        job.result()
