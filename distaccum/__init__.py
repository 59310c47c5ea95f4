"""distaccum: distributed training with gradient accumulation that reduces once per effective batch."""

__version__ = "0.1.0"
