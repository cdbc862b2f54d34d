"""The runtime's errors."""
from __future__ import annotations

from specc.errors import SpeccError


class RunError(SpeccError):
    """Bad inputs to a built model, or a build directory that cannot be run."""


class ServeError(SpeccError):
    """`specc serve` cannot start: the serve environment is missing, or the build cannot be served."""
