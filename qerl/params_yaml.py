"""The YAML of a params file or of a `-S section.key=value` value, read within a budget.

A params file is a few KB of sections and keys (params/*.yaml: 1-2 KB, three levels deep). YAML can say far more in
as little: an alias names a node again, so nine levels of anchors each naming the one before ten times ("billion
laughs") are 10^9 values in 2 KB, and an anchor can name the node that holds it (a structure without end). PyYAML
shares an aliased node rather than copying it, but whatever walks the result pays the expansion: the map of key
lines, validation, a merge key `<<` (which copies), `qerl params`' dump. So before any node is built, the text's
parse events are counted, and the text is refused in one line naming where (file and line, or the -S flag) when it
is nested deeper than MAX_DEPTH, holds more than MAX_VALUES values once every alias is expanded, or has an alias
inside the node it names; a file larger than MAX_BYTES is refused by its size on disk, before it is read. Aliases
within the budget stay allowed (`<<: *common` sharing a block of settings). Then the text is composed once: the
data and the line of each key come from the same nodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import yaml

MAX_BYTES = 256 * 1024  # 100x the largest params file here; a larger one is another file (a dataset, a log)
MAX_VALUES = 10_000  # scalars and collections, aliases expanded; params/default.yaml has under 200
MAX_DEPTH = 16  # nested collections; a params file uses 3 (sections, keys, a key's list or mapping)

# libyaml's parser where PyYAML was built with it (10x faster), the Python one elsewhere; the same events and nodes.
_Base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ConfigError(ValueError):
    """A bad parameter: the message is one line naming the source, key path and value. Defined here, where the first
    refusals are made, so that this module needs nothing of qerl; `qerl.config` raises it too and is where callers
    import it from."""


class _Loader(_Base):
    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as exc:  # a scalar Python cannot hold: 5000 digits, a February 30
            reason = str(exc).split(";")[0]  # not Python's advice to raise its digit limit
            raise yaml.constructor.ConstructorError(None, None, f"cannot read {shortened(node.value)}: {reason}",
                                                    node.start_mark) from None


def shortened(value: Any, limit: int = 200) -> str:
    """`repr(value)`, cut to `limit` characters with its length said: a message stays one readable line whatever
    the file held (a 200 KB scalar, a key of 10,000 characters)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def read_params_file(path: Path) -> tuple[Any, dict[str, int]]:
    """The data of a params file and the 1-based line of each `section.key` in it. Every refusal is a ConfigError
    naming the file (and the line where there is one)."""
    size = path.stat().st_size  # 0 for a pipe (`--params <(...)`) or a device: their reads below are bounded
    if size > MAX_BYTES:  # by its size: a 100 MB file is neither read nor parsed
        raise ConfigError(f"{path}: {size:,} bytes, too large for a params file (at most {MAX_BYTES // 1024} KiB; "
                          "params/default.yaml is 2 KB): is it the right file?")
    with path.open("rb") as f:
        data = f.read(MAX_BYTES + 1)  # a file that grew since stat, a pipe, /dev/zero: read only up to the budget
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{path}: more than {MAX_BYTES // 1024} KiB, too large for a params file")
    try:
        text = data.decode("utf-8")  # a leading BOM (Windows editors write one) is read as YAML reads it: skipped
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); save the file as UTF-8") \
            from None
    try:
        node = _compose(text, lambda line: f"{path}:{line}")
        lines = _key_lines(node, path)  # first: constructing merges `<<` keys into their mappings' nodes
        return _construct(text, node), lines
    except yaml.YAMLError as exc:
        raise ConfigError(f"{_where(exc, text, path)}: invalid YAML: {_problem(exc)}") from None


def read_value(text: str, source: str) -> Any:
    """A `-S` value as YAML reads it (`8` an int, `[a, b]` a list); text that is no YAML is the literal string (a
    system prompt may start with `*` or hold `: `). Past the budget it is refused, naming `source`."""
    try:
        return _construct(text, _compose(text, lambda line: source))
    except yaml.YAMLError:
        return text


def _compose(text: str, where: Callable[[int], str]) -> yaml.Node | None:
    _check_budget(text, where)
    loader = _Loader(text)
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


def _construct(text: str, node: yaml.Node | None) -> Any:
    if node is None:
        return None
    loader = _Loader(text)  # a constructor over the node already composed: nothing is parsed again
    try:
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_budget(text: str, where: Callable[[int], str]) -> None:
    """Count the parse events (no node is built): depth, values with every alias expanded, aliases into their own
    node. Each anchor's expanded size is known when its node closes, so an alias costs one lookup, not a walk."""
    loader = _Loader(text)
    try:
        sizes: dict[str, int] = {}  # anchor -> values it expands to
        open_nodes: list[list] = []  # [anchor, values so far] of each collection not yet closed
        total = 0
        while not loader.check_event(yaml.StreamEndEvent):
            event = loader.get_event()
            line = event.start_mark.line + 1
            if isinstance(event, yaml.AliasEvent):
                if any(anchor == event.anchor for anchor, _ in open_nodes):
                    raise ConfigError(f"{where(line)}: alias *{event.anchor} is inside the node it names (a "
                                      "structure without end); write the values out")
                if event.anchor not in sizes:  # (libyaml's composer would say so without the name)
                    raise yaml.composer.ComposerError(None, None, f"found undefined alias {event.anchor!r}",
                                                      event.start_mark)
                values = sizes[event.anchor]
            elif isinstance(event, yaml.CollectionStartEvent):
                open_nodes.append([event.anchor, 1])
                total += 1
                if len(open_nodes) > MAX_DEPTH:
                    raise ConfigError(f"{where(line)}: nested more than {MAX_DEPTH} levels deep; a params file "
                                      "nests sections, keys and their values (3 levels)")
                continue
            elif isinstance(event, yaml.CollectionEndEvent):
                anchor, values = open_nodes.pop()
                if anchor is not None:
                    sizes[anchor] = values
                if open_nodes:
                    open_nodes[-1][1] += values
                continue  # its values were counted as they came
            elif isinstance(event, yaml.ScalarEvent):
                values = 1
                if event.anchor is not None:
                    sizes[event.anchor] = 1
            else:  # stream and document boundaries
                continue
            total += values
            if open_nodes:
                open_nodes[-1][1] += values
            if total > MAX_VALUES:
                named = f" (alias *{event.anchor} expands to {values:,})" if isinstance(event, yaml.AliasEvent) else ""
                raise ConfigError(f"{where(line)}: more than {MAX_VALUES:,} values once aliases are expanded{named}; "
                                  "a params file holds a few hundred (is it a YAML bomb?)")
    finally:
        loader.dispose()


def _key_lines(root: yaml.Node | None, source: Path) -> dict[str, int]:
    """Map 'section.key' to its 1-based line, for error messages. A section or key set twice in one mapping is
    refused naming both lines: YAML loaders keep the last silently, so a run would use a value the reader of the
    file may not have seen (`rank: 16` above, `rank: 4` further down). Bounded by the budget checked before."""
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            line = key_node.start_mark.line + 1
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge" \
                    and key_node.value in seen:
                raise ConfigError(f"{source}:{line}: {path} is set twice (lines {seen[key_node.value]} and "
                                  f"{line}); keep one")
            if isinstance(key_node, yaml.ScalarNode):
                seen[key_node.value] = line
            lines[path] = line
            walk(value_node, path)

    walk(root, "")
    return lines


def _where(exc: yaml.YAMLError, text: str, path: Path) -> str:
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"{path}:{mark.line + 1}"
    position = getattr(exc, "position", None)  # a reader's error (a control character) has a position only
    return f"{path}:{text.count(chr(10), 0, position) + 1}" if position is not None else str(path)


def _problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.reader.ReaderError):
        code = ord(exc.character) if isinstance(exc.character, str) else exc.character  # libyaml's: a number
        return f"character #x{code:04x} is not allowed in YAML text"
    parts = [getattr(exc, "context", None), getattr(exc, "problem", None)]
    return "; ".join(p for p in parts if p) or str(exc)
