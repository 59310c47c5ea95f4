"""Choosing the split: ``accum.micro_batch=auto`` trial windows and ``distaccum plan``'s predictions."""
