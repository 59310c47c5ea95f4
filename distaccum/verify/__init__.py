"""Verification: a run compared step by step with plain PyTorch taking the whole batch in one process."""
