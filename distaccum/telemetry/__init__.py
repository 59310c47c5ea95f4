"""What a run reports about itself: the communication ledger, the step timer, peak memory, the
per-step record sinks (console, JSONL, wandb), the run summary, the gradient noise scale and the
reports drawn from finished runs."""
