"""The result store: one SQLite file shared by every command and worker."""

from che_bench.store.reads import ORIGINAL, describe_protocol
from che_bench.store.result_store import ResultStore, default_store_path
from che_bench.store.run_prefixes import resolve_run_ids

__all__ = [
    "ORIGINAL",
    "ResultStore",
    "default_store_path",
    "describe_protocol",
    "resolve_run_ids",
]
