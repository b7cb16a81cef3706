"""che-bench: length generalization of positional encodings on the Chomsky-hierarchy tasks."""

__version__ = "0.1.0"
