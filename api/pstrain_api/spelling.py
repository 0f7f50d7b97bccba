"""What to say about a field name that is not known: its right spelling, when the user
wrote a snake_case name for a camelCase field (the API server refuses batch_size for
batchSize), else the closest known name. Pure."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from pydantic.alias_generators import to_camel


def spelling_hint(key: str, known: Sequence[str]) -> str:
    """'; it is spelled batchSize', '; the closest known field is steps', or '' when
    nothing is close."""
    spelled = to_camel(key)
    if spelled != key and spelled in known:
        return f"; it is spelled {spelled}"
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return f"; the closest known field is {close[0]}" if close else ""
