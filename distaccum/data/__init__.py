"""The input pipeline: the global-batch order (which samples each step, rank and micro-batch takes),
windows of micro-batches through a ``DataLoader``, and streams cut into windows."""
