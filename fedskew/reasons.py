"""Why a reply was lost, as one bounded line: the exception's type and message, not its wrappers.

A ClientApp exception reaches the server as the reply's `error.reason`, which Flower writes as
`<class 'T'>:<'message'>` (`flwr/supernode/runtime/run_clientapp.py` in deployment,
`flwr/server/superlink/fleet/vce/vce_api.py` in simulation). In a simulation T is Ray's
`RayTaskError(ClientAppException)` and the message is Ray's rendering of the whole chained traceback:
the ClientApp's own exception first, then, after "The above exception was the direct cause of the
following exception:", Flower's `ClientAppException` wrapper raised by its Ray actor. The first 500
characters of that text end inside the stack frames, before the exception that says what went wrong.

`short_reason` finds, in each part of such a chain, the exception line that ends it (the first
unindented line after the last indented one: frames and code are indented, the exception is not) and
keeps the last one that is not a wrapper (`ClientAppException`, `RayTaskError`); a text with no
traceback keeps its Flower type and message; anything else is kept as it is. The result is one line
(the message's lines joined by " / ") of at most `limit` characters.
"""

from __future__ import annotations

import re

LIMIT = 500  # characters of a reason kept in failures.jsonl
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FLOWER = re.compile(r"<class '(?P<type>[^']*)'>:<'(?P<body>.*)'>", re.DOTALL)
_CHAINED = re.compile(
    r"^\s*(?:The above exception was the direct cause of the following exception:"
    r"|During handling of the above exception, another exception occurred:)\s*$",
    re.MULTILINE,
)
_EXCEPTION = re.compile(r"(?P<type>[A-Za-z_][\w.]*(?:\([\w.]*\))?)(?::[ \t]*(?P<message>.*))?", re.DOTALL)
_WRAPPER_MESSAGE = re.compile(r"^\s*Exception ClientAppException occurred\. Message:\s*")
WRAPPERS = ("ClientAppException", "RayTaskError")


def _is_wrapper(exc_type: str) -> bool:
    return exc_type.rsplit(".", 1)[-1].startswith(WRAPPERS)


def _one_line(text: str) -> str:
    return " / ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def _raised(block: str) -> tuple[str, str] | None:
    """(type, message) of the exception that ends one traceback of a chain, if it has one."""
    lines = block.strip("\n").splitlines()
    indented = [i for i, line in enumerate(lines) if line[:1].isspace()]
    tail = "\n".join(lines[indented[-1] + 1 :] if indented else lines)
    match = _EXCEPTION.fullmatch(tail.strip())
    return (match["type"], match["message"] or "") if match else None


def exception_of(text: str) -> tuple[str, str] | None:
    """(type, message) of the exception a Flower error reason or a traceback text reports, or None
    when the text is neither (see the module docstring)."""
    text = _ANSI.sub("", text)
    flower = _FLOWER.fullmatch(text.strip())
    body = flower["body"] if flower else text
    blocks = _CHAINED.split(body)
    if len(blocks) > 1 or re.search(r'^\s*File "', body, re.MULTILINE):
        raised = [r for r in map(_raised, blocks) if r is not None]
        if raised:
            exc_type, message = next((r for r in reversed(raised) if not _is_wrapper(r[0])), raised[-1])
            return exc_type, _WRAPPER_MESSAGE.sub("", message)
    if flower:
        return flower["type"], _WRAPPER_MESSAGE.sub("", body)
    return None


def short_reason(text: str, limit: int = LIMIT) -> str:
    """`Type: message` of the exception `text` reports (else `text` itself), one line of at most
    `limit` characters."""
    found = exception_of(text)
    line = _one_line(f"{found[0]}: {found[1]}" if found else _ANSI.sub("", text))
    return line if len(line) <= limit else line[: limit - 3] + "..."
