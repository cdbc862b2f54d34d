"""The importers' error: a checkpoint folder or GGUF file that cannot be imported, or a config
specc cannot express. Its own module (above the family modules, specc.importers.families, and both
readers, specc.importers.hf and specc.importers.gguf), so that a family's GGUF row can refuse a
file without importing either reader."""
from __future__ import annotations

from specc.errors import SpeccError


class CheckpointError(SpeccError):
    """A checkpoint folder that cannot be imported, or a config specc cannot express."""
