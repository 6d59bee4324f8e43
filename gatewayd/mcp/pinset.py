"""Pinned MCP tools as pure data: names, digests, the pin file's bytes, and what changed.

An operator approves a declared server's tools once (``gatewayd mcp pin``); from then on
only those tools, with exactly the description and input schema approved, are gateway
tools. A server that later changes what a tool says it does (a "rug pull": a new
description that instructs the model, a schema that asks for more) is refused until the
operator approves again. This module holds every decision about pins and no I/O:
:mod:`gatewayd.mcp.pins` reads and writes the files.

A pin file is checked whole before anything in it is trusted: unknown fields, another
server's name, a gateway name that is not the mapping of its MCP name, two pins of one
name, or a digest that is not the digest of the pinned description and schema (an edit
by hand, a damaged disk) each refuse the file, never a single tool.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import msgspec

from gatewayd.apps.problems import invisible_character, invisible_reason
from gatewayd.protocol import MAX_ID_CHARS, TOOL_NAME_RE

# A declared server's name: one segment of a gateway tool name, short enough that
# ``mcp.<server>.<tool>`` leaves room for the tool.
SERVER_NAME_RE: Final = re.compile(r"[a-z][a-z0-9_]{0,31}")
# The prefix of every MCP tool's gateway name (policies allow ``mcp.<server>.*``).
GATEWAY_PREFIX: Final = "mcp"
# The pin file's format; a file of another version is refused, not guessed at.
PIN_FILE_VERSION: Final = 1
# Tools one server may have pinned: tools.list shows every allowed one in one frame,
# and a server offering more than this is not a tool set an operator reviews by eye.
MAX_PINNED_TOOLS: Final = 256
# What a pinned description may hold: MCP descriptions are prose for a model; one far
# longer is a payload, and it is shown in every tools.list and every pin file.
MAX_DESCRIPTION_CHARS: Final = 16_000
# A pinned input schema, as canonical JSON: big enough for any real tool's arguments.
MAX_SCHEMA_BYTES: Final = 64_000
# How much of a changed description `gatewayd mcp diff` shows on each side.
DIFF_DESCRIPTION_CHARS: Final = 400
# Segments the name mapping prefixes to a tool name not starting with a letter.
_LEADING: Final = "t_"
_NOT_NAME_CHAR: Final = re.compile(r"[^a-z0-9_]")
_canonical: Final = msgspec.json.Encoder(order="sorted")


class PinError(ValueError):
    """Tools that cannot be pinned as asked (a name clash, a name that maps to nothing,
    too many tools, one not offered); ``str()`` names the tools and what to do."""


class PinFileError(ValueError):
    """A pin file that is not to be trusted; ``str()`` says what is wrong and how to
    make a good one (pin again)."""


class LiveTool(Protocol):
    """A tool as a server offers it now (gatewayd.mcp.remote.RemoteTool is one)."""

    @property
    def name(self) -> str: ...
    @property
    def description(self) -> str: ...
    @property
    def input_schema(self) -> Mapping[str, Any]: ...


class PinnedTool(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, rename="camel"
):
    """One approved tool: what the server called it, its gateway name, what it said it
    does and takes, their digest, and who approved it when."""

    mcp_name: str
    gateway_name: str
    description: str
    input_schema: dict[str, Any]
    digest: str
    pinned_at: str  # ISO 8601, UTC
    pinned_by: str  # the operator, as the host knows them (user name and uid)


class PinSet(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every pinned tool of one server, sorted by gateway name (the pin file's body)."""

    version: int
    server: str
    tools: tuple[PinnedTool, ...]

    def by_mcp_name(self) -> dict[str, PinnedTool]:
        return {pin.mcp_name: pin for pin in self.tools}

    def by_gateway_name(self) -> dict[str, PinnedTool]:
        return {pin.gateway_name: pin for pin in self.tools}


class ChangeKind(enum.StrEnum):
    """What differs between a pinned tool and the server's live one."""

    DESCRIPTION = "description"
    INPUT_SCHEMA = "input schema"
    NEW = "new tool"  # offered, never pinned: unavailable until pinned
    REMOVED = "removed tool"  # pinned, no longer offered


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolChange:
    """One difference, for `gatewayd mcp diff`, the refusal of a call and its audit."""

    kind: ChangeKind
    mcp_name: str
    gateway_name: str  # "" when the name maps to nothing a gateway tool can be called
    detail: str  # what exactly differs, for a person

    def to_json(self) -> dict[str, str]:
        return {
            "kind": str(self.kind),
            "mcpName": self.mcp_name,
            "gatewayName": self.gateway_name,
            "detail": self.detail,
        }


def check_server_name(server: str) -> str:
    """``server`` if it is a declared server's name shape. Error handling: PinError."""
    if not SERVER_NAME_RE.fullmatch(server):
        raise PinError(
            f"{server[:64]!r} is not an MCP server name: a lowercase letter, then up to 31 "
            "lowercase letters, digits or underscores"
        )
    return server


def tool_segment(mcp_name: str) -> str:
    """The last segment of a gateway name for the MCP tool ``mcp_name``: lowercased,
    every character outside ``[a-z0-9_]`` replaced by ``_``, and ``t_`` put before one
    that does not start with a letter (gateway name segments do). Several MCP names can
    map to one segment; :func:`map_names` refuses that."""
    segment = _NOT_NAME_CHAR.sub("_", mcp_name.lower())
    if not segment[:1].isalpha() or not segment[:1].isascii():
        segment = _LEADING + segment
    return segment


def gateway_name(server: str, mcp_name: str) -> str:
    """``mcp.<server>.<tool segment>``. Error handling: PinError when the name is empty
    or the result is longer than a tool name may be."""
    if not mcp_name:
        raise PinError(f"server {server} offers a tool with an empty name; it cannot be pinned")
    name = f"{GATEWAY_PREFIX}.{check_server_name(server)}.{tool_segment(mcp_name)}"
    if len(name) > MAX_ID_CHARS or not TOOL_NAME_RE.fullmatch(name):
        raise PinError(
            f"tool {mcp_name[:64]!r} of server {server} maps to {name[:80]!r}, longer than "
            f"the {MAX_ID_CHARS} characters a tool name may have; it cannot be pinned"
        )
    return name


def map_names(server: str, mcp_names: Iterable[str]) -> dict[str, str]:
    """MCP name to gateway name for each of ``mcp_names``. Error handling: PinError
    naming every pair of MCP names that map to one gateway name (neither is pinned: the
    operator cannot tell which one a call would reach)."""
    mapped: dict[str, str] = {}
    taken: dict[str, str] = {}
    clashes: list[str] = []
    for mcp_name in mcp_names:
        if mcp_name in mapped:
            clashes.append(f"{mcp_name!r} is offered twice")
            continue
        name = gateway_name(server, mcp_name)
        if name in taken:
            clashes.append(f"{taken[name]!r} and {mcp_name!r} both map to {name}")
        taken.setdefault(name, mcp_name)
        mapped[mcp_name] = name
    if clashes:
        raise PinError(
            f"server {server}'s tool names clash once mapped to gateway names: "
            + "; ".join(clashes)
            + ". Pin the others with --tool, leaving these out, or rename them in the server"
        )
    return mapped


def tool_digest(name: str, description: str, input_schema: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON (sorted keys, no whitespace) of
    ``{name, description, inputSchema}``: equal tools, equal digests."""
    body = _canonical.encode(
        {"name": name, "description": description, "inputSchema": input_schema}
    )
    return "sha256:" + hashlib.sha256(body).hexdigest()


def make_pins(
    server: str,
    live: Sequence[LiveTool],
    *,
    only: Sequence[str] | None,
    previous: PinSet | None,
    at: str,
    by: str,
) -> PinSet:
    """The pins after the operator approves ``live`` (every tool the server offers, or
    ``only`` those MCP names, keeping the other pins of ``previous``). A tool not
    offered any more loses its pin when every tool is pinned; with ``only``, the pins
    not named stay as they were.

    Error handling: PinError for a name in ``only`` the server does not offer, names
    that clash, a description or schema over its cap, more than MAX_PINNED_TOOLS.
    """
    offered = {tool.name: tool for tool in live}
    if only is not None:
        missing = sorted(set(only) - set(offered))
        if missing:
            raise PinError(
                f"server {server} does not offer {', '.join(map(repr, missing))}; it offers "
                + (", ".join(sorted(map(repr, offered))) or "no tools")
            )
        chosen = [offered[name] for name in dict.fromkeys(only)]
        kept = [
            pin for pin in (previous.tools if previous else ()) if pin.mcp_name not in set(only)
        ]
    else:
        chosen, kept = list(live), []
    mapped = map_names(server, [*(pin.mcp_name for pin in kept), *(t.name for t in chosen)])
    pins = [*kept, *(_pin(server, tool, mapped[tool.name], at=at, by=by) for tool in chosen)]
    if len(pins) > MAX_PINNED_TOOLS:
        raise PinError(
            f"server {server} would have {len(pins)} pinned tools, more than "
            f"{MAX_PINNED_TOOLS}; pin the ones the runs need with --tool"
        )
    return PinSet(
        version=PIN_FILE_VERSION,
        server=server,
        tools=tuple(sorted(pins, key=lambda pin: pin.gateway_name)),
    )


def _pin(server: str, tool: LiveTool, name: str, *, at: str, by: str) -> PinnedTool:
    schema = dict(tool.input_schema)
    if len(tool.description) > MAX_DESCRIPTION_CHARS:
        raise PinError(
            f"tool {tool.name!r} of server {server} has a description of "
            f"{len(tool.description)} characters, over {MAX_DESCRIPTION_CHARS}; not pinned"
        )
    if len(_canonical.encode(schema)) > MAX_SCHEMA_BYTES:
        raise PinError(
            f"tool {tool.name!r} of server {server} has an input schema over "
            f"{MAX_SCHEMA_BYTES} bytes; not pinned"
        )
    for where, text in _texts(tool.name, tool.description, schema):
        found = invisible_character(text)
        if found is not None:
            # What the operator approves must be what the model reads: a zero-width or
            # tag character carries instructions no pin review shows.
            raise PinError(
                f"tool {tool.name!r} of server {server}: its {where} holds {found[1]} at "
                f"character {found[0]}. {invisible_reason('It')}; not pinned"
            )
    return PinnedTool(
        mcp_name=tool.name,
        gateway_name=name,
        description=tool.description,
        input_schema=schema,
        digest=tool_digest(tool.name, tool.description, schema),
        pinned_at=at,
        pinned_by=by,
    )


def _texts(name: str, description: str, schema: Any) -> Iterable[tuple[str, str]]:
    """Every text of a tool a model reads: its name, its description, and each string of
    its input schema (property names, descriptions, enums, defaults)."""
    yield "name", name
    yield "description", description
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            yield "input schema", node
        elif isinstance(node, Mapping):
            for key, value in node.items():
                stack += [str(key), value]
        elif isinstance(node, list):
            stack += node


# -- the pin file ---------------------------------------------------------------------

_encoder: Final = msgspec.json.Encoder(order="deterministic")
_decoder: Final = msgspec.json.Decoder(PinSet)


def encode_pin_file(pins: PinSet) -> bytes:
    """The pin file's bytes: pretty JSON, so an operator can read (not edit) it."""
    return msgspec.json.format(_encoder.encode(pins), indent=2) + b"\n"


def decode_pin_file(data: bytes, *, server: str, where: str) -> PinSet:
    """The pins in ``data``, the pin file of ``server`` (``where`` names it in messages),
    checked whole. Error handling: PinFileError saying what is wrong; nothing of a file
    that fails a check is used."""
    repin = f"Pin the server's tools again: gatewayd mcp pin {server}"
    try:
        pins = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise PinFileError(f"{where} is not a pin file ({exc}). {repin}") from None
    except msgspec.DecodeError as exc:
        raise PinFileError(f"{where} is not valid JSON ({exc}). {repin}") from None
    if pins.version != PIN_FILE_VERSION:
        raise PinFileError(
            f"{where} is a pin file of version {pins.version}; this gatewayd reads version "
            f"{PIN_FILE_VERSION}. {repin}"
        )
    if pins.server != server:
        raise PinFileError(f"{where} holds the pins of server {pins.server!r}, not {server}")
    if len(pins.tools) > MAX_PINNED_TOOLS:
        raise PinFileError(f"{where} pins more than {MAX_PINNED_TOOLS} tools. {repin}")
    try:
        mapped = map_names(server, [pin.mcp_name for pin in pins.tools])
    except PinError as exc:
        raise PinFileError(f"{where}: {exc}") from None
    for pin in pins.tools:
        if pin.gateway_name != mapped[pin.mcp_name]:
            raise PinFileError(
                f"{where}: tool {pin.mcp_name!r} is pinned as {pin.gateway_name!r}, but its "
                f"gateway name is {mapped[pin.mcp_name]!r}: the file was edited. {repin}"
            )
        if pin.digest != tool_digest(pin.mcp_name, pin.description, pin.input_schema):
            raise PinFileError(
                f"{where}: the digest of tool {pin.mcp_name!r} does not match its pinned "
                f"description and input schema: the file was edited or damaged. {repin}"
            )
    return pins


# -- what changed ---------------------------------------------------------------------


def changes_of(pin: PinnedTool, live: LiveTool) -> tuple[ToolChange, ...]:
    """How the live tool differs from its pin (empty: not at all)."""
    out: list[ToolChange] = []
    if live.description != pin.description:
        out.append(
            ToolChange(
                kind=ChangeKind.DESCRIPTION,
                mcp_name=pin.mcp_name,
                gateway_name=pin.gateway_name,
                detail=f"pinned {_shown(pin.description)}, now {_shown(live.description)}",
            )
        )
    if _canonical.encode(dict(live.input_schema)) != _canonical.encode(pin.input_schema):
        out.append(
            ToolChange(
                kind=ChangeKind.INPUT_SCHEMA,
                mcp_name=pin.mcp_name,
                gateway_name=pin.gateway_name,
                detail=schema_difference(pin.input_schema, live.input_schema),
            )
        )
    return tuple(out)


def diff(server: str, pins: PinSet | None, live: Sequence[LiveTool]) -> tuple[ToolChange, ...]:
    """Every difference between ``server``'s pins (None: none yet) and its live tools:
    changed pinned tools, tools offered but not pinned, pinned tools no longer offered;
    by gateway name."""
    pinned = pins.by_mcp_name() if pins is not None else {}
    offered = {tool.name: tool for tool in live}
    out: list[ToolChange] = []
    for name, tool in offered.items():
        pin = pinned.get(name)
        if pin is not None:
            out.extend(changes_of(pin, tool))
            continue
        try:
            mapped = gateway_name(server, name)
        except PinError:
            mapped = ""
        out.append(
            ToolChange(
                kind=ChangeKind.NEW,
                mcp_name=name,
                gateway_name=mapped,
                detail=f"offered, not pinned: {_shown(tool.description)}",
            )
        )
    for name, pin in pinned.items():
        if name not in offered:
            out.append(
                ToolChange(
                    kind=ChangeKind.REMOVED,
                    mcp_name=name,
                    gateway_name=pin.gateway_name,
                    detail="pinned, no longer offered by the server",
                )
            )
    return tuple(sorted(out, key=lambda c: (c.gateway_name or c.mcp_name, str(c.kind))))


def schema_difference(pinned: Mapping[str, Any], live: Mapping[str, Any]) -> str:
    """Where two input schemas differ, for a person: properties added, removed or
    changed, the required list, any other top-level key."""
    parts: list[str] = []
    old_props = _properties(pinned)
    new_props = _properties(live)
    added = sorted(set(new_props) - set(old_props))
    removed = sorted(set(old_props) - set(new_props))
    changed = sorted(
        key
        for key in set(old_props) & set(new_props)
        if _canonical.encode(old_props[key]) != _canonical.encode(new_props[key])
    )
    for label, keys in (("added", added), ("removed", removed), ("changed", changed)):
        if keys:
            parts.append(f"properties {label}: {', '.join(keys[:16])}")
    if sorted(_list(pinned.get("required"))) != sorted(_list(live.get("required"))):
        parts.append(
            f"required was {_list(pinned.get('required'))}, now {_list(live.get('required'))}"
        )
    others = sorted(
        key
        for key in set(pinned) | set(live)
        if key not in ("properties", "required")
        and _canonical.encode(pinned.get(key)) != _canonical.encode(live.get(key))
    )
    if others:
        parts.append(f"{', '.join(others[:16])} changed")
    return "; ".join(parts) or "the schema differs"


def _properties(schema: Mapping[str, Any]) -> dict[str, Any]:
    props = schema.get("properties")
    return {str(k): v for k, v in props.items()} if isinstance(props, Mapping) else {}


def _list(value: Any) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


def _shown(text: str) -> str:
    if len(text) <= DIFF_DESCRIPTION_CHARS:
        return repr(text)
    return repr(text[:DIFF_DESCRIPTION_CHARS]) + f"…[{len(text)} chars]"
