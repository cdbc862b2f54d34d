"""specc's version: the one place it is written (pyproject.toml reads it from here; the package,
`specc --version` and every build's manifest import it)."""

__version__ = "0.1.0"
