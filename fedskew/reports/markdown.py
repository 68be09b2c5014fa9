"""Text from files (the claims file, suite labels, result files) made safe to put into the Markdown
fedskew generates (docs/results.md, docs/leaderboard.md, README.md, a suite's results.md).

Such text is data, not markup the page's author wrote: a `|` or a line break in a claim would end
its table cell or row, `<script>` would reach a renderer that passes HTML through, and a link to
`javascript:...` would run in a reader's browser. `md` shows each of them as the text it is; what
the claims file means as Markdown (emphasis, code spans, links to notes and to http(s) pages) stays.
"""

from __future__ import annotations

import re

SAFE_SCHEMES = ("http", "https", "mailto")  # a link target with another scheme is shown as text
_PUNCTUATION = set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")  # what a backslash escapes in Markdown
_ENTITY = re.compile(r"&(?=#?\w+;)")  # an `&` that would start a character reference
_LINK_TARGET = re.compile(r"\]\(\s*<?\s*([A-Za-z][A-Za-z0-9+.\-]*):")  # `](scheme:` opens a link
_LINE_BREAK = re.compile(r"[ \t]*(?:\r\n|\r|\n)\s*")
_CELL_PIPE = re.compile(r"(?<!\\)((?:\\\\)*)\|")  # a `|` after an even number of backslashes ends a cell


def _code_spans(text: str) -> list[tuple[int, int]]:
    """Where Markdown (CommonMark) reads code spans in `text`, whose content it shows as it is: a run
    of n backticks, not escaped by a backslash, up to the next run of exactly n."""
    spans, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in _PUNCTUATION:
            i += 2
            continue
        if text[i] != "`":
            i += 1
            continue
        run = len(text[i:]) - len(text[i:].lstrip("`"))
        close = next((m for m in re.finditer(r"`+", text[i + run :]) if len(m[0]) == run), None)
        if close is None:
            i += run  # literal backticks
            continue
        end = i + run + close.end()
        spans.append((i, end))
        i = end
    return spans


def _outside_code(text: str) -> str:
    """Links with an unsafe scheme broken, then HTML shown as text, in text outside code spans."""
    text = _LINK_TARGET.sub(lambda m: m[0] if m[1].lower() in SAFE_SCHEMES else "]\\(" + m[0][2:], text)
    return _ENTITY.sub("&amp;", text).replace("<", "&lt;").replace(">", "&gt;")


def md(text: object, cell: bool = True) -> str:
    """`text` as Markdown that shows it (module docstring); `cell`: one table cell of one row, so `|`
    is escaped and a line break becomes a space (else, for a paragraph of prose, both are kept)."""
    text = str(text)
    if cell:
        text = _LINE_BREAK.sub(" ", text)
    out, at = [], 0
    for start, end in _code_spans(text):
        out += [_outside_code(text[at:start]), text[start:end]]
        at = end
    text = "".join([*out, _outside_code(text[at:])])
    return _CELL_PIPE.sub(r"\1\\|", text) if cell else text


def md_link(text: object, target: str) -> str:
    """`[text](target)`, or the text alone where `target` is not a plain relative path or an http(s) or
    mailto address (a `javascript:` target, or one whose spaces or brackets would end the link)."""
    scheme = re.match(r"\s*([A-Za-z][A-Za-z0-9+.\-]*):", target)
    plain = not re.search(r"[\s<>()\[\]`\\]", target) and (scheme is None or scheme[1].lower() in SAFE_SCHEMES)
    return f"[{md(text)}]({target})" if plain and target else md(text)


def md_code_block(lines: list[str], info: str = "text") -> list[str]:
    """`lines` as a fenced code block whose fence no line can close (longer than any run of backticks
    in them)."""
    longest = max((len(run) for line in lines for run in re.findall(r"`+", line)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + info, *lines, fence]
