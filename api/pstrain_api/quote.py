"""How a bad value appears in a message: its repr, shortened; and text from elsewhere (an
exception, a replica's output) flattened to one line.

Every message that quotes a user's value goes through `quote`, so a 7 MB string or a
list of a million items is shown as its head and tail, never in full (reprlib does the
shortening without building the whole repr first).
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

MAX_QUOTED = 80  # characters of a quoted string before it is shortened

_REPR = reprlib.Repr()
_REPR.maxstring = MAX_QUOTED
_REPR.maxother = MAX_QUOTED
_REPR.maxlong = 40
_REPR.maxlevel = 2
_REPR.maxdict = 4
_REPR.maxlist = 6
_REPR.maxtuple = 6
_REPR.maxset = 6


def quote(value: Any, *, count: bool = False) -> str:
    """`repr(value)`, shortened to about MAX_QUOTED characters, with YAML's spelling of
    the scalars whose Python repr a manifest's author would not recognise (true, null,
    .inf). A string that is shortened (or any string, with `count=True`) is followed by
    its length, e.g. `'aaaaaa...aaaaaa' (7340032 characters)`."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
    shown = _REPR.repr(value)
    if isinstance(value, str) and (count or len(value) + 2 > MAX_QUOTED):
        shown += f" ({len(value)} characters)"
    return shown


def named(value: str) -> str:
    """A string value as the CRD's CEL messages name it, so that `pstrain validate` and
    the API server print the same sentence: in single quotes as it is (no escapes) when
    it has at most MAX_QUOTED characters and no line break (a message may not hold
    one), else by its length: `a string of 300 characters`."""
    if len(value) <= MAX_QUOTED and "\n" not in value:
        return f"'{value}'"
    return f"a string of {len(value)} characters"


def one_line(text: str, limit: int = 1000) -> str:
    """`text` with its lines joined by spaces, cut to `limit` characters."""
    flat = " ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def describe(exc: BaseException, limit: int = 500) -> str:
    """An exception as one line: `KeyError: 'feature_columns'`."""
    return one_line(f"{type(exc).__name__}: {exc}", limit)
