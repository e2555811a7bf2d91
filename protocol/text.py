"""Strings from the network, made safe to print and to log.

Run names, abort reasons and anything else a peer chose can carry terminal escape sequences
(``ESC [2J`` clears the operator's screen, OSC 8 forges links, a title sequence renames the
window), other control characters, or Unicode format characters that reorder what is shown (bidi
overrides). :func:`sanitize` removes all of them where such a string is decoded, so none reaches a
terminal or a log raw. HTML is a separate matter: the monitor page escapes whatever it renders.
"""

from __future__ import annotations

import re
import unicodedata

_ESCAPE_SEQUENCE = re.compile(
    r"""
    \x1b\[[0-?]*[\x20-/]*[@-~]          # CSI: ESC [ parameters intermediates final
    | \x9b[0-?]*[\x20-/]*[@-~]           # CSI, 8-bit form
    | (?:\x1b[\]P^_X]|[\x9d\x90\x9e\x9f\x98])  # OSC, DCS, PM, APC, SOS ...
      [^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c|$)  # ... up to BEL or ST, or the end
    | \x1b[\x20-/]*[0-~]                 # any other ESC sequence (two or more characters)
    """,
    re.VERBOSE,
)

_WHITESPACE_CONTROLS = str.maketrans({"\t": " ", "\n": " ", "\r": " ", "\v": " ", "\f": " "})


def sanitize(text: str, *, max_chars: int | None = None) -> str:
    """``text`` without escape sequences, control characters or Unicode format characters.

    Tabs and line breaks become spaces, so the result is one line; every other character of
    Unicode categories Cc, Cf, Cs, Co and Cn is dropped, after whole escape sequences are.

    Args:
        text: a string a peer sent (anything else is first turned into ``repr``).
        max_chars: cut the result to this many characters, the last one an ellipsis; None: no cut.

    Returns:
        A printable, single-line string.
    """
    if not isinstance(text, str):
        text = repr(text)
    text = _ESCAPE_SEQUENCE.sub("", text).translate(_WHITESPACE_CONTROLS)
    text = "".join(c for c in text if not unicodedata.category(c).startswith("C"))
    if max_chars is not None and len(text) > max_chars:
        text = text[: max(0, max_chars - 1)] + "…"
    return text
