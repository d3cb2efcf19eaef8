"""Run logging: metrics.jsonl, wandb, console, token dumps, end-of-run summary."""
