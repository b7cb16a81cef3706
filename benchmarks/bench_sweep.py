"""Sweep throughput (runs per minute) of the smoke suite, local and Ray, with 1 and 2 workers.

    .venv/bin/python benchmarks/bench_sweep.py [--runs 24] [--suite tasks/smoke.toml]

Each configuration runs the first ``--runs`` grid points of the suite into a fresh store;
the wall time includes starting the worker processes (the Ray instance is started once
before, ~3 s, not counted).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rich.console import Console

from che_bench.device_memory import available_cpus
from che_bench.run.suites import load_suite
from che_bench.run.sweep import LocalBackend, run_sweep
from che_bench.store import ResultStore


def measure(name: str, configs, make_backend) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = ResultStore(Path(tmp) / "bench.sqlite")
        quiet = Console(file=open("/dev/null", "w"))  # noqa: SIM115 - closed with the process
        started = time.perf_counter()
        outcome = run_sweep(configs, store, make_backend, console=quiet, live=False)
        seconds = time.perf_counter() - started
    failed = len(outcome.failed)
    print(f"{name:<18} {len(configs)} runs in {seconds:6.1f} s = {60 * len(configs) / seconds:6.1f} "
          f"runs/min" + (f" ({failed} failed)" if failed else ""), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="tasks/smoke.toml")
    parser.add_argument("--runs", type=int, default=24)
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args()
    configs = load_suite(args.suite).configs()[: args.runs]
    print(f"{args.suite}: first {len(configs)} runs; {available_cpus()} CPU cores")
    for workers in (1, 2):
        measure(f"local, {workers} worker(s)", configs, lambda w=workers: LocalBackend(w))
    if args.no_ray:
        return
    import ray

    from che_bench.run.ray_backend import RayBackend

    ray.init(num_cpus=available_cpus(), include_dashboard=False)
    try:
        for workers in (1, 2):
            measure(f"ray, {workers} in flight", configs,
                    lambda w=workers: RayBackend(run_cpus=1, max_in_flight=w))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
