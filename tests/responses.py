"""Reading a dispatcher's :class:`~gatewayd.protocol.Response` in tests: the value of an
allowed call, or the message of a refused one (its code checked)."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from gatewayd.protocol import ErrorCode, Response


def value(response: Response) -> Any:
    """The call's value, decoded; the call must have succeeded."""
    assert response.ok, (response.errorCode, response.safeMessage)
    raw = response.value
    return json.loads(bytes(raw)) if isinstance(raw, msgspec.Raw) else raw


def failure(response: Response, code: ErrorCode) -> str:
    """The message of a call refused or failed with ``code`` (never empty)."""
    assert not response.ok, response.value
    assert response.errorCode is code, (response.errorCode, response.safeMessage)
    assert response.safeMessage
    return response.safeMessage
