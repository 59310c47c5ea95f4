"""Exact accumulation (``accum.exact=true``): every piece's gradient summed in int64 fixed point, so the result has
the same bits for every split of the global batch (docs/verification.md, "Bitwise: the same bits for any split")."""
