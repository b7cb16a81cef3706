"""Reading the store for people: tables, exports, plots and the HTML report."""

#: ``table --format``.
FORMATS = ("text", "csv", "markdown", "latex")
#: ``--metric``: token-level accuracy (the paper's), sequence-level exact match (also named
#: sequence accuracy), token accuracy scaled to chance (Grazzi et al.'s, ``reports.scaled``),
#: or the pooled accuracy (flip-flop's read error is 1 - it).
METRICS = ("token", "exact", "sequence", "scaled", "pooled")
#: ``table --compare``, besides ``none`` and ``paper``: Grazzi et al.'s Table 3 and the
#: published state-tracking tables (``reports.published.COMPARISONS``, in this order), named
#: here so that the command line lists them without importing the models.
COMPARISON_NAMES = ("grazzi", "path", "flip_flop", "pd_ssm", "slice", "deltaproduct")
