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


def reason(e: BaseException) -> str:
    """An exception from a library, as a short clause for one of our one-line messages: an OSError's cause ("No space
    left on device"), else the last line of its message (where torch and safetensors say what went wrong)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    lines = [line for line in str(e).splitlines() if line.strip()]
    return (lines[-1] if lines else type(e).__name__)[:200]
