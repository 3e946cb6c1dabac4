"""The errors a user can cause, each with a one-line message meant for them (see common.config.main_guard).

ConfigError, ModelError and DataError are mistakes in what was asked (exit 2); RunError is a run that
cannot go on (exit 1). Every module raises them from here; nothing else in common/ is needed to catch them.
"""


class ConfigError(ValueError):
    """An impossible option; the message names the option and what was expected."""


class ModelError(ValueError):
    """A model folder or config that we cannot run; the message is one line meant for the user."""


class DataError(ValueError):
    """Bad task name, missing file or malformed line; the message says where and what was expected."""


class RunError(RuntimeError):
    """A run that cannot go on (e.g. diverged); the message is one line and says what is kept."""
