"""Training a pack of runs: the step loop, its batches, histories and checkpoints."""
