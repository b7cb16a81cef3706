"""One module per ``che-bench`` subcommand (see ``che_bench.cli``)."""
