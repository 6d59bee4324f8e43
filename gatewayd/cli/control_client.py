"""A client of the control socket for the commands that talk to a running
`gatewayd serve` (`gatewayd exec`, `gatewayd rules`, `gatewayd apps rules`, `gatewayd
approvals`, `gatewayd mcp`, `gatewayd workspace`): one JSON request over HTTP/1.1 on the
unix socket (:mod:`gatewayd.cli.unix_http`), standard library only; and how those
commands report what it answered."""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Callable

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

    Answer = dict[str, Any]

# What a missing or dead control socket looks like: no daemon serves it (rather than
# something refusing us), so a command that can opens the daemon itself.
NO_DAEMON: Final = frozenset({errno.ENOENT, errno.ECONNREFUSED})


def control_request(
    path: str | os.PathLike[str], method: str, target: str, body: object | None = None
) -> tuple[int, dict[str, Any]]:
    """One JSON request to the control socket at ``path``; (status, decoded body).
    OSError when the socket cannot be reached or answers with no HTTP response
    (:mod:`gatewayd.cli.unix_http`, which says why it is not ``http.client``)."""
    from gatewayd.cli.unix_http import exchange

    data = None if body is None else json.dumps(body).encode()
    status, raw = exchange(os.fspath(path), method, target, data)
    try:
        decoded = json.loads(raw)
    except ValueError:
        decoded = {"ok": False, "message": raw.decode(errors="replace")}
    return status, decoded if isinstance(decoded, dict) else {"ok": False}


def lacks_routes(status: int, answer: Answer) -> bool:
    """Whether the daemon said it has no such route: a gatewayd older than this command."""
    return status == 404 and "no route" in str(answer.get("message", ""))


def print_refusal(command: str, answer: Answer, *, code: object = "failed") -> bool:
    """True when ``answer`` is not ok, its error code (``code`` when it names none) and
    message then printed to stderr after ``command`` (the command line's words)."""
    if answer.get("ok"):
        return False
    print(f"{command}: {answer.get('errorCode', code)}: {answer.get('message')}", file=sys.stderr)
    return True


def ask_else_here(
    prog: str,
    control: str | os.PathLike[str],
    ask: Callable[[], tuple[int, Answer]],
    here: Callable[[], Answer],
    *,
    missing_routes: str,
) -> Answer | None:
    """The answer of the daemon serving ``control`` (``ask``), else, when none serves
    it, of ``here`` (the command in a daemon opened in this process). None, the reason
    printed to stderr after ``prog``, when something else refuses the connection or the
    daemon lacks the routes (``missing_routes`` says which and what to do)."""
    try:
        status, answer = ask()
    except OSError as exc:
        if exc.errno not in NO_DAEMON:
            print(f"{prog}: cannot reach gatewayd at {control}: {exc}", file=sys.stderr)
            return None
        return here()
    if lacks_routes(status, answer):
        print(f"{prog}: the gatewayd at {control} has {missing_routes}", file=sys.stderr)
        return None
    return answer
