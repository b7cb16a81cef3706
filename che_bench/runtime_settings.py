"""The runtime settings: how a run executes (device, threads, numerics, logging), recorded
with it and never in its run id. Declared like every other setting (``che_bench.settings``,
which joins them to ``SETTINGS``)."""

from __future__ import annotations

from che_bench.setting_types import NOT_IN_ID, RUNTIME, SWITCH, Setting, at_least

RUNTIME_SETTINGS: tuple[Setting, ...] = (
    Setting(
        "device",
        str,
        "auto (default: a CUDA GPU when torch sees one, else the CPU), cpu, "
        "cuda or cuda:N; several processes may share one GPU",
        where=RUNTIME,
        in_id=NOT_IN_ID,
        default="auto",
    ),
    Setting(
        "threads",
        int,
        "torch CPU threads per run (default 1, in a sweep's local workers too: these small "
        "models ran many-fold slower with more on a busy machine; a Ray task: its CPUs)",
        where=RUNTIME,
        in_id=NOT_IN_ID,
        metavar="N",
        check=at_least(1),
    ),
    Setting(
        "tf32",
        SWITCH,
        "on a GPU, let matrix products and convolutions use TF32 (faster, "
        "~1e-3 relative error; off by default, recorded with the runs)",
        where=RUNTIME,
        in_id=NOT_IN_ID,
        default=False,
    ),
    Setting(
        "deterministic",
        SWITCH,
        "deterministic algorithms only (cuDNN, cuBLAS, attention): "
        "on a GPU the same seeds give the same numbers again, a little slower; recorded with "
        "the runs",
        where=RUNTIME,
        in_id=NOT_IN_ID,
        default=False,
    ),
    Setting(
        "portable_cpu",
        SWITCH,
        "on a CPU, numerics meant not to depend on the CPU model (torch's AVX2 kernels, MKL's "
        "COMPATIBLE branch, no oneDNN); slower, see docs/protocol.md; recorded with the runs",
        where=RUNTIME,
        in_id=NOT_IN_ID,
        default=False,
    ),
    Setting(
        "log_every",
        int,
        "a training-history row (loss, accuracy, gradient norm, lr, time) "
        "every K steps and at the last step (default 100)",
        where=RUNTIME,
        in_id=NOT_IN_ID,
        default=100,
        metavar="K",
        check=at_least(1),
    ),
    Setting(
        "tensorboard",
        str,
        "also log to TensorBoard event files in DIR/<run id>/ (extra [tensorboard])",
        where=RUNTIME,
        in_id=NOT_IN_ID,
        metavar="DIR",
    ),
    Setting(
        "wandb",
        str,
        "also log to this Weights & Biases project (extra [wandb]; "
        "WANDB_MODE=offline keeps it on disk)",
        where=RUNTIME,
        in_id=NOT_IN_ID,
        metavar="PROJECT",
    ),
)
