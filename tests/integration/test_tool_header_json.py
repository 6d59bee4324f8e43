"""The example tools' JSON reader (examples/include/cogni_tool.h), fuzzed through the
built text.wordcount module under plain wasmtime (no gatewayd: the header alone).

The invariant, as h11 writes its own down: whatever bytes arrive on stdin, the module
either reads them as the JSON document they are (and answers exactly what Python
computes from the same document) or refuses them with exit status 2 and a sentence on
stderr; it never traps, never answers from a document Python refuses, and never refuses
one Python accepts. Python's side is ``json`` held to the same discipline: strict UTF-8,
no NaN or infinity, no lone surrogate, no control character in a string, and the members
the tool reads ("arguments", "text") named once.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import wasmtime
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.exampletools import built_examples
from tests.hypothesis_counts import examples

# What the module may use per input: generous for the inputs below (a few KB).
FUEL = 50_000_000
EXIT_BAD_INPUT = 2
_WORD_SPLIT = re.compile(r"[ \t\n\r\v\f]+")


@dataclass(frozen=True)
class Outcome:
    status: int
    stdout: bytes
    stderr: bytes


class Module:
    """text.wordcount compiled once; each run a fresh store, stdin from a file."""

    def __init__(self, path: Path, scratch: Path) -> None:
        self.engine = wasmtime.Engine(self._config())
        self.module = wasmtime.Module.from_file(self.engine, str(path))
        self.linker = wasmtime.Linker(self.engine)
        self.linker.define_wasi()
        self.scratch = scratch

    @staticmethod
    def _config() -> wasmtime.Config:
        config = wasmtime.Config()
        config.consume_fuel = True
        return config

    def run(self, stdin: bytes) -> Outcome:
        files = {name: self.scratch / name for name in ("in", "out", "err")}
        files["in"].write_bytes(stdin)
        store = wasmtime.Store(self.engine)
        store.set_fuel(FUEL)
        wasi = wasmtime.WasiConfig()
        wasi.stdin_file = str(files["in"])
        wasi.stdout_file = str(files["out"])
        wasi.stderr_file = str(files["err"])
        store.set_wasi(wasi)
        status = 0
        try:
            start = self.linker.instantiate(store, self.module).exports(store)["_start"]
            assert isinstance(start, wasmtime.Func)
            start(store)
        except wasmtime.ExitTrap as exit_trap:
            status = exit_trap.code
        finally:
            store.close()
        return Outcome(status, files["out"].read_bytes(), files["err"].read_bytes())


@pytest.fixture(scope="module")
def wordcount() -> Iterator[Module]:
    with tempfile.TemporaryDirectory(prefix="cg-hdr-") as scratch:
        yield Module(built_examples() / "wordcount" / "wordcount.wasm", Path(scratch))


class Refused(Exception):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    names = [name for name, _ in pairs]
    for read in ("arguments", "text"):  # the members the tool reads: named once
        if names.count(read) > 1:
            raise Refused(f"{read} twice")
    return dict(pairs)


def _no_lone_surrogates(value: Any) -> None:
    texts = [value] if isinstance(value, str) else []
    if isinstance(value, dict):
        texts += list(value)
        for item in value.values():
            _no_lone_surrogates(item)
    elif isinstance(value, list):
        for item in value:
            _no_lone_surrogates(item)
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise Refused("a lone surrogate") from None


def _constant(name: str) -> Any:
    raise Refused(name)


def expected(stdin: bytes) -> dict[str, int] | None:
    """What the tool must answer for ``stdin``, or None when it must refuse it."""
    try:
        document = json.loads(
            stdin.decode("utf-8"), object_pairs_hook=_pairs, parse_constant=_constant
        )
        _no_lone_surrogates(document)
    except (Refused, UnicodeDecodeError, ValueError, RecursionError):
        return None
    args = document.get("arguments") if isinstance(document, dict) else None
    text = args.get("text") if isinstance(args, dict) else None
    if not isinstance(text, str) or "\0" in text:
        return None
    data = text.encode("utf-8")
    return {
        "words": len([w for w in _WORD_SPLIT.split(text) if w]),
        "lines": text.count("\n") + (1 if text and not text.endswith("\n") else 0),
        "chars": len(text),
        "bytes": len(data),
    }


def check(module: Module, stdin: bytes) -> None:
    outcome = module.run(stdin)
    want = expected(stdin)
    if want is None:
        assert outcome.status == EXIT_BAD_INPUT, (stdin, outcome)
        assert outcome.stderr.startswith(b"text.wordcount: "), outcome
        assert outcome.stdout == b""
    else:
        assert outcome.status == 0, (stdin, outcome)
        assert json.loads(outcome.stdout) == want, (stdin, outcome)


# Values of any JSON shape, with the strings most likely to trip a hand-written reader.
texts = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)) | st.sampled_from('\\"/\b\f\n\r\t\0'),
    max_size=40,
)
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)


@st.composite
def documents(draw: st.DrawFn) -> bytes:
    """A document shaped like a call (sometimes not), then perhaps damaged."""
    args = draw(st.dictionaries(texts, values, max_size=3))
    if draw(st.booleans()):
        args["text"] = draw(texts)
    document: Any = {"arguments": args, **draw(st.dictionaries(texts, values, max_size=2))}
    if draw(st.integers(0, 9)) == 0:
        document = draw(values)
    raw = json.dumps(
        document,
        ensure_ascii=draw(st.booleans()),
        indent=draw(st.sampled_from([None, 0, 2])),
    ).encode("utf-8", "surrogatepass")
    for _ in range(draw(st.integers(0, 2))):  # damage: a byte changed, removed or added
        at = draw(st.integers(0, max(len(raw) - 1, 0)))
        byte = bytes([draw(st.integers(0, 255))])
        action = draw(st.sampled_from(["set", "drop", "insert"]))
        if action == "set":
            raw = raw[:at] + byte + raw[at + 1 :]
        elif action == "drop":
            raw = raw[:at] + raw[at + 1 :]
        else:
            raw = raw[:at] + byte + raw[at:]
    return raw


@settings(
    max_examples=examples(400),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(stdin=documents())
def test_the_reader_agrees_with_python_on_any_input(wordcount: Module, stdin: bytes) -> None:
    check(wordcount, stdin)


@pytest.mark.parametrize(
    "stdin",
    [
        b"",
        b" ",
        b"{}",
        b'{"arguments": []}',
        b'{"arguments": {"text": "a"}} x',
        b'{"arguments": {"text": "a"}}{}',
        b'{"arguments": {"text": "a", "text": "b"}}',
        b'{"arguments": {"text": "a"}, "arguments": {"text": "b"}}',
        b'{"arguments": {"text": "\\ud800"}}',
        b'{"arguments": {"text": "\\udc00\\ud800"}}',
        b'{"arguments": {"text": "\\ud83d\\ude00 \\u00e9"}}',
        b'{"arguments": {"text": "a\\u0000b"}}',
        b'{"arguments": {"text": "\xc0\xaf"}}',  # an overlong "/"
        b'{"arguments": {"text": "\xed\xa0\x80"}}',  # a surrogate in UTF-8
        b'{"arguments": {"text": "\xf4\x90\x80\x80"}}',  # past U+10FFFF
        b'{"arguments": {"text": "tab\there"}}',  # a raw control character
        b'{"arguments": {"text": "x", "n": 01}}',
        b'{"arguments": {"text": "x", "n": 1.}}',
        b'{"arguments": {"text": "x", "n": -}}',
        b'{"arguments": {"text": "x", "n": NaN}}',
        b'{"arguments": {"text": "x", "n": 1e999}}',
        b'{"arguments": {"text": "x", "n": tru}}',
        b'{"arguments": {"text": "x",}}',
        b'{"arguments": {"text": "x"}',
        b'{"arguments": {"text": "x\\"}}',
        b'{"arguments": {"text": "\\x"}}',
        b'{"arguments": {"text": "\\u12"}}',
        b'\xef\xbb\xbf{"arguments": {"text": "bom"}}',
        b"[" * 100 + b"]" * 100,
        b'{"arguments": {"text": "deep", "d": ' + b"[" * 60 + b"]" * 60 + b"}}",
    ],
)
def test_hostile_documents_are_read_or_refused_as_python_does(
    wordcount: Module, stdin: bytes
) -> None:
    check(wordcount, stdin)


def test_nesting_past_the_readers_bound_is_refused_not_recursed(wordcount: Module) -> None:
    # Python reads this one; the reader's bound (64) refuses it, with exit 2, not a trap.
    deep = b'{"arguments": {"text": "deep", "d": ' + b"[" * 200 + b"]" * 200 + b"}}"
    outcome = wordcount.run(deep)
    assert outcome.status == EXIT_BAD_INPUT and b"not one JSON value" in outcome.stderr
    flood = wordcount.run(b"[" * 1_000_000)
    assert flood.status == EXIT_BAD_INPUT
