"""Services of a running job: progress and metrics, tracing and the merged timeline, stopping on
a signal, stack dumps, memory figures, faults and the keeper, the Slurm environment."""
