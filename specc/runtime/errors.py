"""The runtime's one error type."""
from __future__ import annotations

from specc.errors import SpeccError


class RunError(SpeccError):
    """Bad inputs to a built model, or a build directory that cannot be run."""
