"""Secrets gatewayd holds on the host, and the scrubber that keeps their values out of
everything gatewayd says (invariant SECRETS_HOST_ONLY, DESIGN.md step 10).

Where a secret comes from (:func:`read_secret`): the environment variable of its name,
else, when that is unset or empty, the file of the same name in the directory systemd
names in ``$CREDENTIALS_DIRECTORY`` (what ``LoadCredential=NAME:/path`` provides). The
configuration only ever holds the *name*; the value is read at use time, so a rotated key
is picked up without a restart.

What is scrubbed (:class:`Scrubber`): every value of every configured name (each model
alias's ``api_key_env`` plus ``secret_env``), replaced by ``[REDACTED:<NAME>]`` in

* the value itself,
* its JSON string escapes (msgspec's, which keep non-ASCII, and Python's ``json``, which
  writes ``\\uXXXX``), so a value inside encoded JSON is found too,
* its percent-encoding (a key echoed back inside a URL),
* its base64, standard and URL-safe alphabets: the value's own encoding (padded), and the
  part that does not depend on what precedes the value for each of the three alignments,
  so a value base64-encoded *inside a longer text* (a ``user:key`` Basic credential, a
  blob) is found as well; up to two bytes' worth of characters at each end of such a
  run mix with the neighbouring text and are left as they are.

Not covered: a value split across separate outputs or chunks, transformed in any other
way (reversed, hex, case-changed, spelled out, compressed, encrypted, double base64), or
shorter than :data:`MIN_SCRUB_CHARS` (a warning is logged once instead: scrubbing a short
value would mangle ordinary text, and a key that short is not a key). Scrubbing is a
backstop for a provider or tool that echoes a key; the primary defence is that no key
ever enters the sandbox.
"""

from __future__ import annotations

import base64
import errno
import functools
import hashlib
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final, Protocol
from urllib.parse import quote

import msgspec

from gatewayd.inputfile import InputFileError, read_input_file

# A value shorter than this is not scrubbed: replacing every "hunter2" or "admin" in
# tool output would mangle ordinary text, and no provider issues keys that short.
MIN_SCRUB_CHARS: Final = 8
# A credential file larger than this is not a key (a certificate chain is ~8 KiB); the
# cap keeps a wrong LoadCredential= path from being read into memory whole.
MAX_CREDENTIAL_BYTES: Final = 64 * 1024
# Values are re-read at most this often: rotation is picked up within a second, and the
# hot path (every audit entry) pays a clock read, not a file read.
REFRESH_INTERVAL_S: Final = 1.0
# Per name, the last this many values stay scrubbed after a rotation: a call that began
# with the old key may still be answered (and echoed) after the new one is in place.
MAX_VALUES_PER_NAME: Final = 4
# What every replacement starts with; the whole replacement is "[REDACTED:<NAME>]".
REDACTION_PREFIX: Final = "[REDACTED:"
# systemd sets this for a service with LoadCredential= / SetCredential=.
CREDENTIALS_DIRECTORY_ENV: Final = "CREDENTIALS_DIRECTORY"
# A secret's name: an environment variable name (and so a safe file name).
NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")

_json_encoder: Final = msgspec.json.Encoder()


class KeyedModel(Protocol):
    """What the scrubber reads of a model alias (gatewayd.config's ModelAlias): the name
    of the variable holding its key. A protocol, so that the configuration depends on this
    module and never the other way round."""

    @property
    def api_key_env(self) -> str | None: ...


class SecretError(Exception):
    """A secret cannot be had. The message names the variable and the credential file
    and says what to do; it never holds the value."""


class SecretMissing(SecretError):
    """Neither the variable nor a credential file holds a value: unset, not unusable."""


class Secret(msgspec.Struct, frozen=True):
    """A secret's value and where it was found (``environment`` or the file's path)."""

    name: str
    value: str
    source: str


def read_secret(
    name: str, environ: Mapping[str, str] | None = None, *, holds: str = "the secret"
) -> Secret:
    """The value of secret ``name``: ``$name``, else ``$CREDENTIALS_DIRECTORY/name``.

    ``environ`` defaults to the process's environment. ``holds`` is how messages say what
    the secret is for ("its key").

    Resource handling: the credential file is opened non-blocking (a FIFO in its place
    cannot hang the caller), read at most ``MAX_CREDENTIAL_BYTES + 1`` bytes, and closed.
    One trailing newline is dropped (``echo KEY > file``); nothing else is stripped.

    Error handling: :class:`SecretMissing` when neither place has a non-empty value;
    :class:`SecretError` when the file is unreadable, not a regular file, over the cap,
    or not UTF-8. ValueError for a ``name`` that is not a variable name (a caller's bug:
    the configuration checks it).
    """
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"{name!r} is not a secret name ({NAME_RE.pattern})")
    env = os.environ if environ is None else environ
    value = env.get(name, "")
    if value:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # os.environ keeps undecodable bytes as surrogates
            raise SecretError(
                f"the environment variable {name} that holds {holds} is not UTF-8 text"
            ) from None
        return Secret(name, value, "environment")
    unset = f"the environment variable {name} that holds {holds} is not set (or empty)"
    todo = (
        f"set {name} where the gatewayd service gets its environment (for example a "
        f"systemd EnvironmentFile), or give it as a systemd credential "
        f"(LoadCredential={name}:/path/to/file)"
    )
    directory = env.get(CREDENTIALS_DIRECTORY_ENV, "")
    if not directory:
        raise SecretMissing(
            f"{unset} in gatewayd's environment, and ${CREDENTIALS_DIRECTORY_ENV} is not "
            f"set, so there is no systemd credential {name} either; {todo}"
        )
    path = Path(directory) / name
    raw = _read_credential(path, name, holds)
    if raw is None:
        raise SecretMissing(
            f"{unset} in gatewayd's environment, and there is no credential file {path}; {todo}"
        )
    if raw.endswith(b"\n"):
        raw = raw[:-1]
    try:
        value = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SecretError(
            f"the credential file {path} that holds {holds} ({name}) is not UTF-8 text "
            f"(byte {exc.start}); store the value as text"
        ) from None
    if not value:
        raise SecretMissing(
            f"{unset} in gatewayd's environment, and the credential file {path} is empty; {todo}"
        )
    return Secret(name, value, str(path))


def _read_credential(path: Path, name: str, holds: str) -> bytes | None:
    """The file's bytes, None when it does not exist; SecretError when it cannot be used
    (not a regular file: a FIFO would block the read; larger than any key)."""
    where = f"the credential file {path} that holds {holds} ({name})"
    try:
        return read_input_file(path, max_bytes=MAX_CREDENTIAL_BYTES, what=where)
    except InputFileError as exc:
        if exc.errno == errno.ENOENT:
            return None
        if exc.too_large:
            todo = "which is not a key; check the path given to LoadCredential="
        else:
            todo = "check it and its permissions for the user gatewayd runs as"
        raise SecretError(f"{exc}, {todo}") from None


# --- the encodings a value is looked for in ------------------------------------------------


def encodings(value: str) -> frozenset[str]:
    """Every form of ``value`` the scrubber replaces (see the module docstring)."""
    raw = value.encode("utf-8")
    forms = {value, quote(value, safe="")}
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        forms.add(encode(raw).decode("ascii"))
        for skip in range(3):  # the value starts at each offset within a 3-byte group
            core = raw[skip:]
            core = core[: len(core) - len(core) % 3]
            if len(core) >= 6:  # at least 8 base64 characters, like MIN_SCRUB_CHARS
                forms.add(encode(core).decode("ascii"))
    escaped = set()
    for form in forms:
        escaped.add(_json_encoder.encode(form)[1:-1].decode("utf-8"))
        escaped.add(json.dumps(form)[1:-1])
    return frozenset(forms | escaped)


class _Forms(msgspec.Struct, frozen=True):
    """Everything to look for, made once per change of the values."""

    text: tuple[str, ...]  # longest first
    data: tuple[bytes, ...]  # the same, UTF-8
    labels: Mapping[str, str]  # form -> "[REDACTED:NAME]"
    pattern: re.Pattern[str]  # the forms, longest first, one alternation

    def scrub(self, text: str) -> str:
        """``text`` with every form replaced; the same object when none is in it."""
        for form in self.text:
            if form in text:
                break
        else:
            return text
        labels = self.labels
        return self.pattern.sub(lambda match: labels[match.group()], text)


_NO_FORMS: Final = _Forms((), (), {}, re.compile(r"(?!)"))  # matches nothing


def redact(text: str, name: str, value: str) -> str:
    """``text`` with every form of ``value`` replaced by ``[REDACTED:<name>]``, in one
    pass, whatever the value's length (for a message about that very value)."""
    return _forms_of(name, value).scrub(text) if value else text


@functools.lru_cache(maxsize=16)
def _forms_of(name: str, value: str) -> _Forms:
    # Cached: model_client redacts the same key from every answer (a few keys, and
    # the process holds them anyway).
    return _build_forms({name: [value]}, min_chars=1)


def _build_forms(values: Mapping[str, list[str]], min_chars: int = MIN_SCRUB_CHARS) -> _Forms:
    labels: dict[str, str] = {}
    for name, seen in values.items():
        for value in reversed(seen):  # the newest value first (the label is the same)
            if len(value) < min_chars:
                continue
            for form in encodings(value):
                labels.setdefault(form, f"{REDACTION_PREFIX}{name}]")  # first name wins
    if not labels:
        return _NO_FORMS
    # Longest first: a secret that contains another is replaced whole, and an
    # alternation tries its branches in order at each position.
    text = tuple(sorted(labels, key=lambda form: (-len(form), form)))
    pattern = re.compile("|".join(re.escape(form) for form in text))
    return _Forms(text, tuple(form.encode("utf-8") for form in text), labels, pattern)


class UnscrubbableError(ValueError):
    """A secret is still in JSON after every string in it was scrubbed: it spans the
    JSON's own syntax (a value holding quotes), so the JSON must be withheld."""


class Scrubber:
    """Replaces the values of the named secrets with ``[REDACTED:<NAME>]``.

    ``names`` are the secrets' names (see :func:`read_secret`). Their values are read on
    first use and again at most every ``refresh_s`` (``clock`` is monotonic seconds), so a
    rotated key is scrubbed within that time; the last ``MAX_VALUES_PER_NAME`` values of
    each name stay scrubbed. A scrubber without names costs one attribute test per call.
    ``warn`` logs, once per name and value, a value too short to scrub or a credential
    that cannot be read (False for a second scrubber of the same names, e.g. the logs').

    Thread safety: any thread may call it; one refreshes at a time, the others use the
    values read before.
    """

    def __init__(
        self,
        names: Iterable[str] = (),
        *,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        refresh_s: float = REFRESH_INTERVAL_S,
        warn: bool = True,
    ) -> None:
        self.names: tuple[str, ...] = tuple(dict.fromkeys(names))
        for name in self.names:
            if not NAME_RE.fullmatch(name):
                raise ValueError(f"{name!r} is not a secret name ({NAME_RE.pattern})")
        if not (math.isfinite(refresh_s) and refresh_s >= 0):
            raise ValueError(f"refresh_s must be a finite number >= 0, not {refresh_s!r}")
        self._environ = environ
        self._clock = clock
        self._refresh_s = refresh_s
        self._warn = warn
        self._forms = _NO_FORMS
        self._next_refresh = -math.inf
        self._refreshing = threading.Lock()
        self._values: dict[str, list[str]] = {name: [] for name in self.names}
        self._warned: set[tuple[str, str]] = set()

    @classmethod
    def for_config(
        cls, models: Mapping[str, KeyedModel], secret_env: Iterable[str] = (), **kwargs: Any
    ) -> Scrubber:
        """The scrubber for gatewayd's configuration: every alias's key and ``secret_env``."""
        names = [alias.api_key_env for alias in models.values() if alias.api_key_env]
        return cls([*names, *secret_env], **kwargs)

    # -- looking ------------------------------------------------------------------------

    def current(self) -> _Forms:
        """The forms to look for now, re-reading the values if they are due."""
        if self._clock() >= self._next_refresh and self._refreshing.acquire(blocking=False):
            try:
                self._refresh()
            finally:
                self._refreshing.release()
        return self._forms

    def found_in(self, data: bytes) -> bool:
        """Whether ``data`` (UTF-8, e.g. encoded JSON) holds any form of a secret.

        The hot path: one clock read and a substring test per form.
        """
        if not self.names:
            return False
        for form in self.current().data:  # noqa: SIM110 - any() costs a generator per call
            if form in data:
                return True
        return False

    def text(self, text: str) -> str:
        """``text`` with every secret replaced (the same object when there is none)."""
        if not self.names:
            return text
        return self.current().scrub(text)

    def value(self, value: Any) -> Any:
        """A copy of a JSON-like ``value`` with every string in it (keys too) scrubbed.

        Dicts, lists and tuples are walked; msgspec Structs are turned into builtins
        first; other values (numbers, None) are returned as they are.
        """
        if not self.names:
            return value
        return self._walk(value, self.current())

    def json(self, payload: bytes) -> bytes:
        """Encoded JSON with every secret replaced in every string (the same object when
        there is none); the result is valid JSON of the same shape.

        Error handling: :class:`UnscrubbableError` when a secret remains after every
        string was scrubbed; msgspec.DecodeError when ``payload`` is not JSON.
        """
        if not self.found_in(payload):
            return payload
        scrubbed = _json_encoder.encode(self._walk(msgspec.json.decode(payload), self._forms))
        if self.found_in(scrubbed):
            raise UnscrubbableError("a configured secret spans the JSON's syntax")
        return scrubbed

    def _walk(self, value: Any, forms: _Forms) -> Any:
        if isinstance(value, str):
            return forms.scrub(value)
        if isinstance(value, Mapping):
            return {self._walk(k, forms): self._walk(v, forms) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._walk(item, forms) for item in value]
        if isinstance(value, msgspec.Struct):
            return self._walk(msgspec.to_builtins(value), forms)
        return value

    # -- reading the values --------------------------------------------------------------

    def _refresh(self) -> None:
        """Re-read every value; rebuild the forms if one changed. Takes ~µs per name
        (a file read for a credential), and runs at most every ``refresh_s``."""
        self._next_refresh = self._clock() + self._refresh_s
        changed = False
        for name in self.names:
            try:
                value = read_secret(name, self._environ).value
            except SecretMissing:
                continue  # normal: an alias that is not used, a secret not given yet
            except SecretError as exc:
                self._warn_once(name, str(exc), "secret_unreadable", reason=str(exc))
                continue
            seen = self._values[name]
            if seen and seen[-1] == value:
                continue
            if value in seen:
                seen.remove(value)
            seen.append(value)
            del seen[:-MAX_VALUES_PER_NAME]
            changed = True
            if len(value) < MIN_SCRUB_CHARS:
                self._warn_once(
                    name,
                    hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest(),
                    "secret_too_short_to_scrub",
                    length=len(value),
                    minimum=MIN_SCRUB_CHARS,
                )
        if changed:
            self._forms = _build_forms(self._values)

    def _warn_once(self, name: str, key: str, event: str, **fields: Any) -> None:
        if not self._warn or (name, key) in self._warned:
            return
        self._warned.add((name, key))
        # Imported here, not at the top: structlog (with asyncio) would cost the readers
        # of the audit log (`gatewayd audit verify`) more than the rest of their start.
        import structlog

        structlog.get_logger("gatewayd.secrets").warning(event, name=name, **fields)
