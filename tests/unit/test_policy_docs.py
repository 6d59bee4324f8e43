"""docs/policy.md documents every field of the policy models (a policy
reference checked against the pydantic models).

A field counts as documented when the section of docs/policy.md for its parent holds a
table row whose first cell is the field's name in backticks. The section for a parent
is the one whose heading names the parent's path in backticks (`` ## `network` ``,
`` ### `network.proxy` ``); the top level's is "## Top level". A section ends at the
next heading of any level, so a row in a subsection does not document its parent's
fields. Paths write a mapping's values as ``<name>`` (``filesystem.paths.<name>``) and a
list's entries as ``[]`` (``review.structured[]``).
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from gatewayd.policy import Policy

DOC = Path(__file__).resolve().parents[2] / "docs" / "policy.md"
TOP_LEVEL_HEADING = "Top level"
_HEADING_RE = re.compile(r"^(#{1,6})\s+(.*)$")
_ROW_NAME_RE = re.compile(r"^\|\s*`([^`]+)`\s*\|")


def _nested(annotation: object, path: str) -> Iterator[tuple[type[BaseModel], str]]:
    """The models inside a field's annotation, each with the path its fields sit under."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, path
        return
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        yield from _nested(args[0], path)
    elif origin is dict:
        yield from _nested(args[1], f"{path}.<name>")
    elif origin in (tuple, list):
        yield from _nested(args[0], f"{path}[]")
    elif origin in (typing.Union, types.UnionType):
        for arg in args:
            yield from _nested(arg, path)


def field_paths(model: type[BaseModel], parent: str = "") -> Iterator[tuple[str, str]]:
    """(parent path, field name) of every field of ``model`` and of every model nested
    in it, recursively."""
    for name, field in model.model_fields.items():
        yield parent, name
        here = f"{parent}.{name}" if parent else name
        for nested, path in _nested(field.annotation, here):
            yield from field_paths(nested, path)


def documented_rows(text: str) -> dict[str, set[str]]:
    """Section heading -> the names in the first cell of its table rows."""
    rows: dict[str, set[str]] = {}
    heading = ""
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        match = _HEADING_RE.match(line)
        if match:
            heading = match.group(2)
            rows.setdefault(heading, set())
            continue
        cell = _ROW_NAME_RE.match(line)
        if cell and heading:
            rows[heading].add(cell.group(1))
    return rows


def undocumented(text: str, model: type[BaseModel] = Policy) -> list[str]:
    """Every field path of ``model`` that ``text`` does not document, as ``a.b.c``."""
    rows = documented_rows(text)
    missing = []
    for parent, name in field_paths(model):
        if parent:
            sections = [h for h in rows if f"`{parent}`" in h]
        else:
            sections = [h for h in rows if h == TOP_LEVEL_HEADING]
        if not any(name in rows[h] for h in sections):
            missing.append(f"{parent}.{name}" if parent else name)
    return missing


def test_every_policy_field_is_documented_in_policy_md() -> None:
    missing = undocumented(DOC.read_text())
    assert not missing, f"docs/policy.md does not document: {', '.join(missing)}"


def test_the_walk_reaches_nested_sections_lists_and_mappings() -> None:
    paths = {f"{parent}.{name}" if parent else name for parent, name in field_paths(Policy)}
    for expected in (
        "version",
        "network.proxy.max_connections",
        "filesystem.paths.<name>.mount",
        "review.structured[].regex.pattern",
        "review.rules.allow[].addedBy",
        "review.cache.ttl_s",
        "model_access.max_tokens",
    ):
        assert expected in paths


@pytest.mark.parametrize(
    ("heading", "row", "field"),
    [
        ("### `network.proxy`", "| `max_connections` |", "network.proxy.max_connections"),
        ("## Top level", "| `require_os_sandbox` |", "require_os_sandbox"),
        (
            "### A structured rule: `review.structured[]`",
            "| `skip_model` |",
            "review.structured[].skip_model",
        ),
    ],
)
def test_the_check_fails_when_a_row_is_removed(heading: str, row: str, field: str) -> None:
    text = DOC.read_text()
    start = text.index(heading)
    end = text.find("\n#", start + 1)
    section = text[start:end]
    lines = [line for line in section.splitlines() if not line.startswith(row)]
    assert len(lines) == len(section.splitlines()) - 1  # the row was there, once
    assert undocumented(text[:start] + "\n".join(lines) + text[end:]) == [field]


def test_a_row_in_the_wrong_section_does_not_count() -> None:
    text = """
## Top level
| `version` | int |
### `network.proxy`
| `version` | moved here |
"""

    class Inner(BaseModel):
        version: int

    class Outer(BaseModel):
        version: int
        proxy: Inner

    # `version` under `network.proxy` documents neither the top level's `proxy` row nor
    # the field proxy.version; under `proxy` it documents proxy.version only.
    assert undocumented(text, Outer) == ["proxy", "proxy.version"]
    assert undocumented(text.replace("`network.proxy`", "`proxy`"), Outer) == ["proxy"]


def test_rows_inside_code_blocks_do_not_count() -> None:
    class Only(BaseModel):
        version: int

    assert undocumented("## Top level\n```\n| `version` | x |\n```\n", Only) == ["version"]


# --- the security model page names real tests and real sections ------------------------

DOCS = DOC.parent
TESTS = DOCS.parent / "tests"
_TEST_REF_RE = re.compile(r"`((?:unit/)?test_\w+\.py)::(test_\w+)`")
_LINK_RE = re.compile(r"\]\(([\w./-]+\.md)(?:#([\w-]+))?\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation but - and _ dropped, spaces -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def broken_references(text: str) -> list[str]:
    """Test references (``test_x.py::test_y``) that name no test, and links to a page or
    a heading that does not exist."""
    broken = []
    for module, name in _TEST_REF_RE.findall(text):
        path = TESTS / (module if module.startswith("unit/") else f"integration/{module}")
        source = path.read_text() if path.is_file() else ""
        if not re.search(rf"^(async )?def {name}\(", source, re.MULTILINE):
            broken.append(f"{module}::{name}")
    for page, anchor in _LINK_RE.findall(text):
        target = DOCS / page
        if not target.is_file():
            broken.append(page)
            continue
        if anchor:
            headings = [
                m.group(2) for m in map(_HEADING_RE.match, target.read_text().splitlines()) if m
            ]
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(f"{page}#{anchor}")
    return broken


@pytest.mark.parametrize(
    "page", ["security-model.md", "configuration.md", "policy.md", "mcp.md", "approvals.md"]
)
def test_the_pages_name_existing_tests_pages_and_sections(page: str) -> None:
    assert broken_references((DOCS / page).read_text()) == []


def test_a_renamed_test_or_a_missing_section_is_reported() -> None:
    text = (
        "`test_invariants.py::test_denials_say_what_is_allowed` "
        "`test_invariants.py::test_that_was_renamed` "
        "`unit/test_protocol.py::test_error_codes_are_exactly_the_closed_set` "
        "[a](sandbox.md#threat-model) [b](sandbox.md#no-such-section) [c](nowhere.md)"
    )
    assert broken_references(text) == [
        "test_invariants.py::test_that_was_renamed",
        "sandbox.md#no-such-section",
        "nowhere.md",
    ]
