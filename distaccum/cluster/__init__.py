"""Where the workers run: local and multi-node launch (torch elastic), Slurm, the rank layout, the
process group, stop requests and each rank's sign of life."""
