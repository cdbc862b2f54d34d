"""What the engine refuses, and the one way a failure becomes a line of text.

Both hosts answer these as they are: `specc serve` re-types them as its own errors (RunError, HTTP
400; Busy, 503), the Triton model as Triton's INVALID_ARG and UNAVAILABLE; neither rewrites the
words.
"""


class DecodingError(Exception):
    """Something the engine cannot do, in one line (a graph it cannot decode with, a request it
    does not take)."""


class Refused(DecodingError):
    """A request the engine does not take: the client's mistake (HTTP 400, gRPC INVALID_ARGUMENT).
    `busy`: whether it is a Busy."""

    busy = False


class Busy(Refused):
    """A request the engine cannot take now: its queue is full, or it is shutting down (HTTP 503,
    Triton's UNAVAILABLE). Its message begins with one of BUSY_WORDS."""

    busy = True


# how every Busy's message begins (engine.py writes them): what a host that passes on only the
# words of a refusal (specc serve's HTTP front, behind a Triton whose Python backend answers
# UNAVAILABLE with HTTP 400) knows a busy refusal by
BUSY_WORDS = ("server busy", "server shutting down")


def is_busy(message: str) -> bool:
    """Whether a refusal's message is a Busy's."""
    return message.startswith(BUSY_WORDS)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, stripped; "" where it has none (a caller that
    needs words then names the exception's type)."""
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else ""
