"""specc's errors. Every message a user sees names where the problem is.

Spec errors carry one or more located issues, printed as ``FILE:LINE:COL: key.path: message``
(the form compilers and editors understand). The CLI prints these and exits 1; it never shows a
Python traceback.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Issue:
    """One located problem in a spec file. ``line`` and ``column`` are 1-based."""

    message: str
    key: str = ""
    file: str | None = None
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        where = self.file or "<spec>"
        if self.line is not None:
            where += f":{self.line}:{self.column or 1}"
        key = f" {self.key}:" if self.key else ""
        return f"{where}:{key} {self.message}"

    def to_dict(self) -> dict:
        return asdict(self)


class SpeccError(Exception):
    """Base of every error specc raises on purpose. The CLI turns these into exit code 1."""

    exit_code = 1


class SpecError(SpeccError):
    """A spec that cannot be loaded or is not valid. Holds every issue found, not just the first."""

    def __init__(self, issues: list[Issue] | Issue):
        self.issues = [issues] if isinstance(issues, Issue) else list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))


class WeightsError(SpeccError):
    """A weights file that does not match the spec (names, shapes, dtypes) or cannot be read."""


class BuildError(SpeccError):
    """A build stage that failed."""


class VerificationError(BuildError):
    """An exported artifact that does not compute what the PyTorch graph computes."""


class RuntimeMissingError(SpeccError):
    """A command needs an optional dependency (onnxruntime, tensorrt, ...) that is not installed."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, stripped; "" where it has none (a caller that
    needs words then names the exception's type). specc/decoding/errors.py holds the same
    function for the Triton repository that copies the engine without specc
    (tests/test_house_rules.py holds the two alike)."""
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else ""
