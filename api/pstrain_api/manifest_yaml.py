"""Reading manifest files: bytes -> YAML documents, refusing what would crash or hang.

PyYAML's `safe_load` is safe from code execution, not from size: a 20 000-deep list
exhausts the recursion limit, a "billion laughs" of nested aliases expands into more
values than memory holds, and duplicate keys are taken last-wins without a word. The
`ManifestLoader` here is a SafeLoader with four additions, the first three failing as a
`ManifestLimitError` (a `yaml.MarkedYAMLError`, so it carries its line):

- nesting deeper than MAX_DEPTH is refused while composing, before Python recurses;
- a document whose aliases would expand it beyond MAX_VALUES values (or that refers to
  itself) is refused before it is constructed;
- a key that appears twice in one mapping is refused (YAML 1.2 and the API server's
  strict decoding refuse it too);
- `1e30` and `1.0e3` are floats, as in YAML 1.2 and for the API server, not strings.

`read_manifest_text` adds the byte-level limits: at most MAX_MANIFEST_BYTES, UTF-8 only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .quote import quote

# The API server refuses request bodies over 3 MiB; a manifest cannot be larger.
MAX_MANIFEST_BYTES = 3 * 1024 * 1024
# Real manifests nest about 12 deep (a pod template's affinity); 100 leaves room.
MAX_DEPTH = 100
# Values (scalars, lists, mappings) in one document once aliases are expanded.
MAX_VALUES = 1_000_000

_MERGE_TAG = "tag:yaml.org,2002:merge"
_FLOAT_TAG = "tag:yaml.org,2002:float"
# YAML 1.2 floats that YAML 1.1 (PyYAML) reads as strings: 1e30, 1E-3, 1.0e3, -2e+5.
_FLOAT_12 = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class UnreadableManifest(ValueError):
    """The file breaks a byte-level limit (size, encoding); the message says which."""


class ManifestLimitError(yaml.MarkedYAMLError):
    """Valid YAML that a manifest may not be: too deep, too large once expanded,
    self-referring, or with a key given twice."""

    def __init__(self, problem: str, mark: yaml.Mark) -> None:
        super().__init__(problem=problem, problem_mark=mark)


class ManifestLoader(yaml.SafeLoader):
    """SafeLoader with a depth limit, an expansion bound and no duplicate keys."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ManifestLimitError(
                    f"the values nest more than {MAX_DEPTH} levels deep; a manifest may "
                    f"nest at most {MAX_DEPTH}", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Node | None:
        node = super().compose_document()
        if node is not None:
            _measure(node, {}, set(), 1)
        return node

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            first: dict[Any, Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = first.setdefault(key, key_node)
                except TypeError:
                    continue  # an unhashable key: the constructor refuses it below
                if earlier is not key_node:
                    raise ManifestLimitError(
                        f"the key {quote(key)} appears twice in one mapping (first at line "
                        f"{earlier.start_mark.line + 1}, column {earlier.start_mark.column + 1});"
                        " each key may appear once",
                        key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


ManifestLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_12, list("-+0123456789"))


def _measure(node: Node, sizes: dict[int, tuple[int, int]], open_: set[int],
             depth: int) -> tuple[int, int]:
    """(values, height) of `node` with every alias expanded; raises when either bound is
    broken or the node contains itself. Memoised by node, so shared (aliased) subtrees
    are measured once: the cost is the size of the file, not of its expansion."""
    if depth > MAX_DEPTH:
        raise _too_deep(node)
    key = id(node)
    if key in sizes:
        values, height = sizes[key]
    elif key in open_:
        raise ManifestLimitError("an alias refers to a value that contains it; "
                            "a manifest may not refer to itself", node.start_mark)
    else:
        values, height = 1, 1
        if isinstance(node, (SequenceNode, MappingNode)):
            open_.add(key)
            children = (node.value if isinstance(node, SequenceNode)
                        else [n for pair in node.value for n in pair])
            for child in children:
                if isinstance(child, ScalarNode):
                    values += 1
                    height = max(height, 2)
                    continue
                sub_values, sub_height = _measure(child, sizes, open_, depth + 1)
                values += sub_values
                height = max(height, sub_height + 1)
                if values > MAX_VALUES:
                    raise ManifestLimitError(
                        f"its aliases expand the document to more than {MAX_VALUES} values; "
                        f"a manifest may hold at most {MAX_VALUES}", child.start_mark)
            open_.discard(key)
        sizes[key] = (values, height)
    if depth + height - 1 > MAX_DEPTH:
        raise _too_deep(node)
    return values, height


def _too_deep(node: Node) -> ManifestLimitError:
    return ManifestLimitError(f"its aliases nest the values more than {MAX_DEPTH} levels "
                              f"deep; a manifest may nest at most {MAX_DEPTH}",
                              node.start_mark)


def read_manifest_text(path: str | Path) -> str:
    """The text of a manifest file; UnreadableManifest for a file over the size limit or
    not in UTF-8, OSError when it cannot be read."""
    with open(path, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            size = os.fstat(f.fileno()).st_size
            shown = f"{size} bytes" if size > MAX_MANIFEST_BYTES else "larger than that"
            raise UnreadableManifest(
                f"the file is {shown}; a manifest may be at most {MAX_MANIFEST_BYTES} bytes "
                "(3 MiB, the API server's request limit)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableManifest(
            f"the file is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}); a manifest must be YAML in UTF-8") from None


def load_all(text: str) -> list[Any]:
    """Every document in `text` (None for empty ones); yaml.YAMLError when it is not
    acceptable YAML."""
    loader = ManifestLoader(text)
    try:
        docs = []
        while loader.check_data():
            docs.append(loader.get_data())
        return docs
    finally:
        loader.dispose()
