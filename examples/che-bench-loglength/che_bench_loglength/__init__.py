"""Example che-bench plugin: one encoding (``log_length_nope``), one task (``majority``) and
one model (``gru``).

Importing this module registers all three; che-bench imports it at start-up through the entry
point ``che_bench.plugins`` of this distribution (or ``--plugin che_bench_loglength``).
"""

from che_bench_loglength import encoding, model, task  # noqa: F401  (registration on import)

__version__ = "0.1.0"
