"""``cogni-tool``: call the run's gateway from inside the sandbox.

Cold start is most of the cost of a call from a shell script, so the command line is
parsed by hand (argparse alone costs more than the whole call), the client library is
imported only once a command needs it, and JSON goes through cogni_tool.json_codec, not
json (whose import costs more than a bare interpreter start). See docs/cogni-tool.md for
the exit codes.
"""

from __future__ import annotations

import sys

from cogni_tool import __version__

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final, NoReturn

PROG: Final = "cogni-tool"

# Copies of cogni_tool.client constants, so --help and usage errors need not import the
# client (sockets, JSON). A test keeps them equal.
EXIT_USAGE: Final = 2
DEFAULT_TIMEOUT_SECONDS: Final = 60.0
MAX_TIMEOUT_SECONDS: Final = 7 * 24 * 3600.0

# Conventional status of a process stopped by SIGINT (128 + 2).
EXIT_INTERRUPTED: Final = 130

USAGE: Final = """\
usage: cogni-tool exec [--pretty] [--timeout SECONDS] <tool> ['<json-args>' | -]
       cogni-tool list [--json] [--pretty] [--timeout SECONDS]
       cogni-tool mcp [--timeout SECONDS]
       cogni-tool --help | --version

Call a tool through the gateway of the gatewayd run this sandbox belongs to.

commands:
  exec <tool> [args]  call <tool>; args is a JSON object (default {}), or - to read it
                      from stdin. Prints the tool's JSON result on one line.
  list                print the tools this run may call, one per line: name  summary
  mcp                 serve the run's tools to an MCP client over stdio (docs/mcp.md)
  serve ...           (started by gatewayd) the run's OpenAI endpoint and egress bridge

options:
  --pretty            indent the JSON output
  --json              (list) print the raw tool list, with each tool's argsSchema, as JSON
  --timeout SECONDS   wait at most this long for the answer (default 60; 0 waits forever)
  -h, --help          show this help
  -V, --version       show the version

environment (set by gatewayd for the run):
  COGNI_GATEWAY_SOCK  path of the gateway socket
  COGNI_RUN_ID        id of this run

exit status: 0 ok, 2 usage, 3 no gateway, 4 protocol error, 10-21 and 23-25 the
gateway's error code (bad_request, too_large, run_mismatch, authz_denied, unknown_tool,
policy_denied, invalid_args, review_denied, rate_limited, timeout, tool_failed, internal;
23 confirmation_required, 24 limit_exceeded, 25 approval_denied), 22 an error code
this cogni-tool does not know. Errors are printed as "cogni-tool: <code>: <message>".

example:
  cogni-tool exec fs.read '{"path": "notes.txt"}'
"""

_ARGS_HINT: Final = (
    "pass args as one JSON object in single quotes, e.g. "
    'cogni-tool exec fs.read \'{"path": "notes.txt"}\', or - to read them from stdin'
)


class UsageError(Exception):
    """The command line is wrong; the message says what is expected."""


class Options:
    """What the command line asked for."""

    __slots__ = ("args_text", "as_json", "command", "pretty", "timeout", "tool")

    def __init__(self, command: str) -> None:
        self.command = command
        self.tool = ""
        self.args_text: str | None = None
        self.pretty = False
        self.as_json = False
        self.timeout: float | None = DEFAULT_TIMEOUT_SECONDS


def _parse_timeout(text: str) -> float | None:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= MAX_TIMEOUT_SECONDS:
        raise UsageError(
            f"--timeout takes a number of seconds up to {MAX_TIMEOUT_SECONDS:.0f} "
            f"(0 waits forever), got {text!r}"
        )
    return None if seconds == 0 else seconds


def parse_command_line(argv: list[str]) -> Options:
    """Parse ``argv`` (without the program name) or raise :class:`UsageError`."""
    if not argv:
        raise UsageError("missing command: use 'exec' or 'list' (see cogni-tool --help)")
    command, rest = argv[0], argv[1:]
    if command not in ("exec", "list"):
        raise UsageError(
            f"unknown command {command!r}; the commands are exec and list (see cogni-tool --help)"
        )
    options = Options(command)
    flags = {"--pretty", "--timeout"} | ({"--json"} if command == "list" else set())
    positional: list[str] = []
    i = 0
    while i < len(rest):
        word = rest[i]
        i += 1
        if word == "--":
            positional.extend(rest[i:])
            break
        if not word.startswith("--") or word == "-":
            positional.append(word)
            continue
        name, has_value, value = word.partition("=")
        if name not in flags:
            allowed = ", ".join(sorted(flags))
            raise UsageError(f"unknown option {name!r} for {command}; its options are {allowed}")
        if name == "--timeout":
            if not has_value:
                if i >= len(rest):
                    raise UsageError("--timeout needs a number of seconds")
                value = rest[i]
                i += 1
            options.timeout = _parse_timeout(value)
        elif has_value:
            raise UsageError(f"{name} takes no value")
        elif name == "--pretty":
            options.pretty = True
        else:
            options.as_json = True
    if command == "list":
        if positional:
            raise UsageError(f"list takes no arguments, got {positional[0]!r}")
        return options
    if not positional:
        raise UsageError("exec needs a tool name, e.g. cogni-tool exec fs.read '{...}'")
    if len(positional) > 2:
        raise UsageError(
            f"exec takes a tool name and at most one args argument, got {len(positional)} "
            f"words; {_ARGS_HINT}"
        )
    options.tool = positional[0]
    if len(positional) == 2:
        options.args_text = positional[1]
    return options


def parse_args_json(text: str) -> dict[str, Any]:
    """The tool arguments in ``text``, which must be a JSON object."""
    from cogni_tool.json_codec import decode

    try:
        value = decode(text)
    except ValueError as exc:
        raise UsageError(f"args are not valid JSON ({exc}); {_ARGS_HINT}") from None
    if not isinstance(value, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean"}.get(
            type(value), "null" if value is None else "a number"
        )
        raise UsageError(f"args must be a JSON object, got {kind}; {_ARGS_HINT}")
    return value


def _read_args(options: Options) -> dict[str, Any]:
    text = options.args_text
    if text is None:
        return {}
    if text == "-":
        try:
            text = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(f"args on stdin are not UTF-8 ({exc}); {_ARGS_HINT}") from None
    return parse_args_json(text)


def _dumps(value: Any, pretty: bool, ensure_ascii: bool) -> str:
    """``json.dumps(value, ensure_ascii=ensure_ascii, indent=2 if pretty else None)``."""
    if pretty:
        # Not the hot path, and json's C encoder cannot indent: json itself does it.
        import json

        return json.dumps(value, ensure_ascii=ensure_ascii, indent=2)
    from cogni_tool.json_codec import encode

    # json.dumps's separators when it does not indent; NaN and Infinity cannot come from
    # the gateway's JSON, and 1e999 prints as Infinity, as json.dumps prints it.
    return encode(value, ensure_ascii=ensure_ascii, allow_nan=True, separators=(", ", ": "))


def _emit(value: Any, pretty: bool) -> None:
    try:
        data = _dumps(value, pretty, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (legal in JSON escapes, not in UTF-8): keep it escaped.
        data = _dumps(value, pretty, ensure_ascii=True).encode("ascii")
    # Bytes, not text: the output is UTF-8 JSON whatever locale the sandbox has.
    sys.stdout.buffer.write(data + b"\n")
    sys.stdout.flush()


def _tool_lines(value: Any) -> list[str]:
    from cogni_tool.client import ProtocolError

    if not isinstance(value, list) or not all(
        isinstance(tool, dict) and isinstance(tool.get("name"), str) for tool in value
    ):
        raise ProtocolError(
            "tools.list answered with something other than a list of "
            '{"name", "summary", "argsSchema"} objects'
        )
    width = max((len(tool["name"]) for tool in value), default=0)
    lines = []
    for tool in value:
        summary = tool.get("summary")
        summary = " ".join(summary.split()) if isinstance(summary, str) else ""
        lines.append(f"{tool['name']:<{width}}  {summary}".rstrip())
    return lines


def _run(options: Options) -> int:
    from cogni_tool.client import Client

    args = _read_args(options) if options.command == "exec" else {}
    with Client(timeout=options.timeout) as client:
        if options.command == "exec":
            _emit(client.call(options.tool, args), options.pretty)
            return 0
        tools = client.call("tools.list", {})
    if options.as_json:
        _emit(tools, options.pretty)
        return 0
    lines = _tool_lines(tools)
    sys.stdout.buffer.write("".join(line + "\n" for line in lines).encode("utf-8", "replace"))
    sys.stdout.flush()
    return 0


def _fail(code: str, message: str) -> None:
    sys.stderr.flush()
    sys.stderr.buffer.write(f"{PROG}: {code}: {message}\n".encode("utf-8", "replace"))
    sys.stderr.flush()


def _wants_help(words: list[str]) -> bool:
    """True when -h/--help appears anywhere before a ``--``."""
    for word in words:
        if word == "--":
            return False
        if word in ("-h", "--help"):
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` and return the exit status.

    Without ``argv``, this is the cogni-tool program itself (the console script and
    ``python -m cogni_tool`` call it so): it runs ``sys.argv[1:]``, then flushes stdout
    and stderr and ends the process with the status at once, without returning. That
    skips the interpreter's teardown (freeing every module and object), about 2.5 ms
    that a shell loop would pay on every call for nothing: the connection is closed and
    the output written by then, and cogni-tool registers no exit handlers.
    """
    if argv is not None:
        return _main(list(argv))
    _end_process(_main(sys.argv[1:]))


def _main(words: list[str]) -> int:
    if words[:1] == ["serve"]:  # gatewayd starts it in the sandbox; its own parser
        from cogni_tool.serve import main as serve

        return serve(words[1:])
    if words[:1] == ["mcp"]:  # a long-lived server an MCP client starts; its own parser
        from cogni_tool.mcp_server import main as mcp

        return mcp(words[1:])
    if _wants_help(words):
        sys.stdout.write(USAGE)
        return 0
    if words[:1] in (["-V"], ["--version"]):
        sys.stdout.write(f"{PROG} {__version__}\n")
        return 0
    try:
        return _run(parse_command_line(words))
    except UsageError as exc:
        _fail("usage", str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _fail("interrupted", "stopped by SIGINT; a call in flight may still run")
        return EXIT_INTERRUPTED
    except Exception as exc:
        from cogni_tool.client import CogniToolError, ToolError, exit_code_for

        if not isinstance(exc, CogniToolError):
            raise
        _fail(exc.code, exc.safe_message if isinstance(exc, ToolError) else str(exc))
        return exit_code_for(exc)


def _end_process(status: int) -> NoReturn:
    """Flush stdout and stderr, then end the process with ``status``, skipping teardown.

    Error handling: a failed flush (stdout closed early) raises, and the interpreter then
    exits the ordinary way, reporting it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        from posix import _exit  # built in, unlike os (1.8 ms to import)
    except ImportError:  # pragma: no cover - not a POSIX system
        from os import _exit
    _exit(status)


if __name__ == "__main__":
    sys.exit(main())
