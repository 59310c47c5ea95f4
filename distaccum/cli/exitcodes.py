"""Exit codes of every ``distaccum`` command (the library's launcher returns the same numbers)."""

EXIT_OK = 0
"""Success (verify: every candidate matched; report: every comparable run agreed)."""
EXIT_FAIL = 1
"""A worker failed, verify found a mismatch, or report found disagreeing runs."""
EXIT_CONFIG = 2
"""Bad input: an invalid config, component or argument, reported before any worker starts."""
EXIT_REQUEUE = 3
"""Stopped on request after writing a checkpoint; rerun the same command to resume
(== :data:`distaccum.runtime.stopping.EXIT_REQUEUE`)."""
