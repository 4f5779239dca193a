"""The exceptions hpcps raises for bad input, each with the exit code the job ends with.

Every module raises one of these (never ``assert``) for input it refuses; ``train.py`` turns
them into one message and one exit code on every rank.
"""


class HpcpsError(Exception):
    """Base class: a problem with what the user asked for, not a bug in hpcps."""

    exit_code = 1


class ConfigError(HpcpsError):
    """Unknown option or config key, bad value, impossible layout of ranks."""

    exit_code = 2


class DataError(HpcpsError):
    """Dataset missing, unreadable, or not in the layout hpcps expects."""

    exit_code = 3


class CheckpointError(HpcpsError):
    """Checkpoint missing, truncated, corrupt, or from an incompatible model."""

    exit_code = 4
