"""The demo's model provider: an OpenAI-compatible chat endpoint on loopback that plays
two parts from a script, since `make demo` reaches no real model.

* **The note taker's model** (an app's conversation): first it tries to store a
  password (its reviewer denies that by the app's rules), then it writes the note into
  its data folder, then it answers its caller.
* **The reviewer** (its system prompt says it reviews a tool call): it applies the note
  taker's rules as a model would: a write outside ``/app/data`` or anything that looks
  like a password is denied with the rule's reason; everything else is allowed.

Standard library only; it serves in a thread until the demo stops it.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

NOTE = "- the gateway reviews every call an app makes, against the app's own rules\n"


def _review(messages: list[dict[str, Any]]) -> str:
    call = messages[-1]["content"]
    if "password" in call:
        return "DENY: the rule 'Storing anything that looks like a password' denies it"
    if ('"fs.write"' in call or '"fs.edit"' in call) and '"/app/data/' not in call:
        return "DENY: the rule 'Writing ... any file outside data/' denies it"
    return "ALLOW"


def _app_turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
    done = sum(1 for m in messages if m.get("role") == "tool")
    if done == 0:
        return _call("write", {"path": "data/secrets.md", "content": "password: hunter2\n"})
    if done == 1:
        return _call("write", {"path": "data/gateway.md", "content": NOTE})
    return {"role": "assistant", "content": "Noted in data/gateway.md (passwords I may not keep)."}


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    }


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # quiet: the demo prints
        return

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        messages = body.get("messages", [])
        system = messages[0].get("content", "") if messages else ""
        if "You review one tool call" in system:
            message: dict[str, Any] = {"role": "assistant", "content": _review(messages)}
        else:
            message = _app_turn(messages)
        reply = {
            "id": "demo",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "demo"),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                }
            ],
            "usage": {"prompt_tokens": 40, "completion_tokens": 10, "total_tokens": 50},
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def start() -> tuple[ThreadingHTTPServer, str]:
    """Serve on an ephemeral loopback port; (the server, its OpenAI base URL)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"
