"""Reading the store for people: tables, exports, plots and the HTML report."""

#: ``table --format``.
FORMATS = ("text", "csv", "markdown", "latex")
#: ``--metric``: token-level accuracy (the paper's), sequence-level exact match, or token
#: accuracy scaled to chance (Grazzi et al.'s, ``reports.scaled``).
METRICS = ("token", "exact", "scaled")
