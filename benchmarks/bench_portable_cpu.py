"""Portable CPU numerics: do capped instruction sets change a run, repeat it bit for bit, and
what do they cost?

Each mode runs the same short trainings in a fresh process (the settings are read when torch,
MKL and oneDNN start, so they must be in the environment before ``import torch``), one mode
after another, ``--repeats`` times in turn (so that a busy machine slows every mode alike).
The modes: ``default`` (nothing set); one variable each (``aten_avx2``: torch's own kernels at
AVX2; ``mkl_compatible`` / ``mkl_avx2_strict``: MKL's reproducibility branch; ``onednn_avx2``);
``capped_avx2`` (all three capped at AVX2, MKL's AVX2 branch in strict mode); ``portable``
(che-bench's ``--portable-cpu``: torch at AVX2, MKL's COMPATIBLE branch, oneDNN capped and
turned off in torch). The runs:

* ``transformer``: the laptop suite's Kerple + DAPE V2 (kernel 3) cell on
  missing_duplicate_string, quick-preset model, ``--steps`` steps, 3 test lengths;
* ``lstm``: a one-member LSTM (its fused ``torch.lstm`` evaluation is what reaches oneDNN on
  a CPU) on parity_check, hidden size 16, the same steps.

Per mode and run it prints torch's CPU capability, MKL's reproducibility branch as MKL reports
it (read from the library: ``off``, ``AUTO``, ``COMPATIBLE``, ...), a digest of the final
weights and of the per-step loss curve, the score, and, over the repeats (median, min-max,
each), the training's wall seconds and the CPU seconds of the whole run (training and
evaluation; less sensitive to other jobs on a shared machine). Nothing is asserted; every
figure is measured on this machine, whose CPU is printed first.

    python benchmarks/bench_portable_cpu.py [--steps 300] [--repeats 3] [--modes default,portable]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from che_bench.checks.portable_reference import weights_digest
from che_bench.cpu import PORTABLE_ENVIRONMENT, cpu_model

#: The environment of each mode (unset variables are removed from the child's environment).
MODES: dict[str, dict[str, str]] = {
    "default": {},
    "aten_avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "mkl_compatible": {"MKL_CBWR": "COMPATIBLE"},
    "mkl_avx2_strict": {"MKL_CBWR": "AVX2,STRICT"},
    "onednn_avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "capped_avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_CBWR": "AVX2,STRICT",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    # che-bench's --portable-cpu: its environment, and oneDNN off in torch.
    "portable": dict(PORTABLE_ENVIRONMENT),
}
#: The modes that run as ``--portable-cpu`` does (``RuntimeOptions.portable_cpu``).
PORTABLE_MODES = {"portable"}
VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
#: MKL's CNR branch codes (mkl_cbwr.h).
MKL_BRANCHES = {0: "off", 1: "off", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 10: "AVX2",
                12: "AVX512"}


def mkl_branch() -> str:
    """MKL's reproducibility branch in this process, as MKL reports it (its service symbol in
    torch's library); "?" where it cannot be read."""
    import torch

    try:
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        code = library.mkl_serv_cbwr_get(1)
    except (OSError, AttributeError):
        return "?"
    return MKL_BRANCHES.get(code, str(code))


def child(steps: int, portable: bool) -> None:
    """Train the runs in this process and print one JSON line."""
    import torch

    from che_bench.config import make_config
    from che_bench.run.runner import execute_runs

    torch.set_num_threads(1)
    small = {"seed": 0, "length_seed": 0, "steps": steps, "test_lengths": "41,100,200"}
    configs = {
        "transformer": make_config("missing_duplicate_string", "kerple", 3, "quick", **small),
        "lstm": make_config("parity_check", preset="quick", arch="lstm",
                            arch_options={"hidden_size": 16}, **small),
    }
    out: dict[str, object] = {"capability": torch.backends.cpu.get_cpu_capability()}
    with tempfile.TemporaryDirectory() as models:
        for name, config in configs.items():
            started = time.process_time()
            (result,) = execute_runs([config], device="cpu", progress=False, log_every=1,
                                     models_dir=models, portable_cpu=portable)
            cpu_s = time.process_time() - started
            curve = json.dumps([row["loss"] for row in result.history]).encode()
            out[name] = {
                "weights": weights_digest(Path(models) / f"{config.run_id()}.pt")[:12],
                "losses": hashlib.sha256(curve).hexdigest()[:12],
                "final_loss": result.history[-1]["loss"],
                "score": result.score,
                "train_s": result.timings["train_s"],
                "cpu_s": cpu_s,
            }
    out["mkl_branch"] = mkl_branch()
    print(json.dumps(out))


def run_mode(mode: str, steps: int) -> dict:
    environment = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    environment.update(MODES[mode], OMP_NUM_THREADS="1")
    finished = subprocess.run(
        [sys.executable, __file__, "--child", "--steps", str(steps),
         *(["--portable"] if mode in PORTABLE_MODES else [])],
        env=environment, capture_output=True, text=True, check=True,
    )
    return json.loads(finished.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--portable", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.steps, args.portable)
        return
    modes = args.modes.split(",")
    print(f"CPU: {cpu_model()}; {args.steps} steps per run, 1 thread, {args.repeats} repeats")
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode in modes:
            results[mode].append(run_mode(mode, args.steps))
    reference = results[modes[0]][0]
    for mode in modes:
        first = results[mode][0]
        onednn = "; oneDNN off in torch" if mode in PORTABLE_MODES else ""
        print(f"\n{mode}: {MODES[mode] or 'no variable set'}{onednn}")
        print(f"  torch capability {first['capability']}, MKL branch {first['mkl_branch']}")
        for run in ("transformer", "lstm"):
            seen = {(r[run]["weights"], r[run]["losses"]) for r in results[mode]}
            times = [r[run]["train_s"] for r in results[mode]]
            cpu_times = [r[run]["cpu_s"] for r in results[mode]]
            same = first[run]["weights"] == reference[run]["weights"]
            same_text = "same as" if same else "differs from"
            print(f"  {run}: weights {first[run]['weights']} losses {first[run]['losses']} "
                  f"({'identical' if len(seen) == 1 else 'DIFFERENT'} over {len(times)} repeats; "
                  f"{same_text} {modes[0]}), final loss {first[run]['final_loss']!r}, "
                  f"score {first[run]['score']!r}")
            for what, values in (("training wall s", times), ("run CPU s", cpu_times)):
                print(f"    {what}: median {statistics.median(values):.2f}, "
                      f"min {min(values):.2f}, max {max(values):.2f} "
                      f"({', '.join(f'{t:.2f}' for t in values)})")


if __name__ == "__main__":
    main()
