"""One YAML discipline for the YAML files gatewayd reads: policies and its configuration.

PyYAML's safe loader constructs only plain data, but it still accepts what gatewayd
must refuse:

- a key given twice in one mapping (the last one wins silently, so a second ``mode:``
  line would quietly override the first);
- nesting deep enough to overflow its recursive composer (a RecursionError);
- anchors and aliases (a few lines of ``&a [*b, *b, ...]`` expand to billions of
  references for the validator to walk; no gatewayd file needs them);
- an integer of thousands of digits (Python refuses past 4300 with a bare ValueError).

So a document is first read as a stream of parser events (PyYAML's parser is a state
machine, not recursive), which checks depth, aliases and number sizes, and only then
constructed. Messages give the line and column and what is wrong, never the
document's text: the file may not be what its name says (a policy name pointing at
``/etc/shadow`` must not answer with its lines). Pure: text in, data out.
"""

from __future__ import annotations

import re
from typing import Any, Final

import yaml

# Deeper than any policy or configuration (about five levels); shallow enough that
# PyYAML's recursive composer never comes near Python's recursion limit.
MAX_DEPTH: Final = 32
# Python's own guard against quadratic int() parsing (sys.get_int_max_str_digits()).
MAX_NUMBER_DIGITS: Final = 4300
_NUMBER_TAGS: Final = frozenset({"tag:yaml.org,2002:int", "tag:yaml.org,2002:float"})
# A quoted part of a PyYAML message: shown when it is a syntax token of at most this
# many characters (',' or ']'), hidden when longer (a piece of the document: a tag).
_QUOTED: Final = re.compile(r"'[^']*'|\"[^\"]*\"")
_SHOWN_TOKEN_CHARS: Final = 2


class YamlInputError(ValueError):
    """A document that is not acceptable YAML; ``str(exc)`` says what and where
    (``line L, column C: ...``) without quoting the document.

    ``line`` and ``column`` (1-based) are where, when known, and ``problem`` is what,
    so a caller that reads YAML embedded in a larger file (an app's front matter) can
    name the line of that file.
    """

    def __init__(self, problem: str, *, line: int | None = None, column: int | None = None):
        where = "" if line is None else f"line {line}, column {column}: "
        super().__init__(where + problem)
        self.problem = problem
        self.line = line
        self.column = column


def _error_at(mark: Any, problem: str) -> YamlInputError:
    if mark is None:
        return YamlInputError(problem)
    return YamlInputError(problem, line=mark.line + 1, column=mark.column + 1)


# libyaml's parser when PyYAML was built with it (Debian's and PyPI's wheels are): the
# same events and marks, many times faster on a hostile megabyte.
_SafeLoader: Final[type[yaml.SafeLoader]] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _StrictSafeLoader(_SafeLoader):  # type: ignore[valid-type,misc]
    """The safe loader, refusing duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable: the base class reports it properly
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    "found a key twice in one mapping",
                    key_node.start_mark,
                )
            seen.add(key)
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def load(text: str) -> Any:
    """The one document in ``text``, checked (see the module docstring).

    Error handling: :class:`YamlInputError` for the first problem found.
    """
    _check_events(text)
    try:
        # A SafeLoader subclass: only plain data types are ever constructed.
        return yaml.load(text, Loader=_StrictSafeLoader)  # noqa: S506
    except yaml.YAMLError as exc:
        raise _problem(exc) from None
    except (ValueError, RecursionError):  # a guard: the event check refuses both first
        raise YamlInputError(
            f"a value is too large or nests too deeply (at most {MAX_NUMBER_DIGITS} digits "
            f"in a number, {MAX_DEPTH} levels of nesting)"
        ) from None


def key_lines(text: str) -> dict[tuple[str | int, ...], int]:
    """The 1-based line of each mapping key and list item in ``text``, by its path
    (keys, and list indexes from 0): where a validation error at that path points.

    Only for a document :func:`load` accepted (so no aliases, bounded depth); keys that
    are not plain scalars are left out.
    """
    lines: dict[tuple[str | int, ...], int] = {}
    try:
        root = yaml.compose(text, Loader=_StrictSafeLoader)
    except yaml.YAMLError:  # not a document load() accepted: no lines to give
        return lines
    pending: list[tuple[tuple[str | int, ...], yaml.Node | None]] = [((), root)]
    while pending:  # a stack, not recursion (load() bounds the depth all the same)
        path, node = pending.pop()
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode):
                    key_path = (*path, str(key_node.value))
                    lines[key_path] = key_node.start_mark.line + 1
                    pending.append((key_path, value_node))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                lines[(*path, index)] = item.start_mark.line + 1
                pending.append(((*path, index), item))
    return lines


def _check_events(text: str) -> None:
    depth = 0
    resolver = _StrictSafeLoader("")  # only its implicit resolvers are used
    try:
        for event in yaml.parse(text, Loader=_StrictSafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise _error_at(
                    event.start_mark,
                    "anchors and aliases (&name, *name) are not accepted; write the value out",
                )
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise _error_at(event.start_mark, f"nested more than {MAX_DEPTH} levels deep")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
            elif (
                isinstance(event, yaml.ScalarEvent)
                and not event.style  # plain: libyaml says "", PyYAML None
                and len(event.value) > MAX_NUMBER_DIGITS
                and resolver.resolve(yaml.ScalarNode, event.value, (True, False)) in _NUMBER_TAGS
            ):
                raise _error_at(
                    event.start_mark, f"a number of more than {MAX_NUMBER_DIGITS} digits"
                )
    except yaml.YAMLError as exc:
        raise _problem(exc) from None


def _hide_long(match: re.Match[str]) -> str:
    shown = match.group()
    return shown if len(shown) <= _SHOWN_TOKEN_CHARS + 2 else "(not shown)"


def _problem(exc: yaml.YAMLError) -> YamlInputError:
    """PyYAML's message without the document's text: its position and its problem,
    quoted pieces longer than a syntax token (a tag, a name) left out."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        what = _QUOTED.sub(_hide_long, exc.problem or exc.context or "invalid YAML")
        if "maximum nesting depth" in what:  # libyaml's own limit, met before ours
            what = f"nested more than {MAX_DEPTH} levels deep"
        return _error_at(mark, f"YAML syntax: {what}")
    return YamlInputError("YAML syntax: the document could not be read")
