"""WebAssembly test modules, as WAT text: WASI preview 1 commands small enough to
compile in milliseconds, one per behaviour the wasm runner must handle.

Each is a function returning WAT source; :func:`wasm` turns it into module bytes.
"""

from __future__ import annotations

import wasmtime

_WASI = "wasi_snapshot_preview1"

# Imports and helpers every module shares: fd_write of a data range, and stdin read
# whole into memory at 65536 (one page is kept below it for scratch and data).
_IMPORTS = f"""
  (import "{_WASI}" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "{_WASI}" "fd_read" (func $fd_read (param i32 i32 i32 i32) (result i32)))
  (import "{_WASI}" "proc_exit" (func $proc_exit (param i32)))
"""
_HELPERS = """
  (func $write (param $fd i32) (param $ptr i32) (param $len i32)
    (i32.store (i32.const 0) (local.get $ptr))
    (i32.store (i32.const 4) (local.get $len))
    (drop (call $fd_write (local.get $fd) (i32.const 0) (i32.const 1) (i32.const 8))))
  (func $read_stdin (result i32)
    (local $total i32)
    (block $done
      (loop $more
        (i32.store (i32.const 16) (i32.add (i32.const 65536) (local.get $total)))
        (i32.store (i32.const 20) (i32.sub (i32.const 65536) (local.get $total)))
        (br_if $done (call $fd_read (i32.const 0) (i32.const 16) (i32.const 1) (i32.const 24)))
        (br_if $done (i32.eqz (i32.load (i32.const 24))))
        (local.set $total (i32.add (local.get $total) (i32.load (i32.const 24))))
        (br $more)))
    (local.get $total))
"""


def wasm(wat: str) -> bytes:
    """The module's bytes."""
    return bytes(wasmtime.wat2wasm(wat))


def _module(body: str, *, pages: int = 2, extra: str = "") -> str:
    return f'(module {_IMPORTS} {extra} {_HELPERS} (memory (export "memory") {pages}) {body})'


def _data(offset: int, text: str) -> str:
    escaped = "".join(f"\\{byte:02x}" for byte in text.encode())
    return f'(data (i32.const {offset}) "{escaped}")'


def echo() -> str:
    """Reads stdin whole and writes it back: the result is ``{"arguments": ...}``."""
    return _module(
        """(func (export "_start")
             (call $write (i32.const 1) (i32.const 65536) (call $read_stdin)))"""
    )


def constant(text: str, *, read_stdin: bool = False) -> str:
    """Writes ``text`` on stdout (reading stdin first, or never)."""
    read = "(drop (call $read_stdin))" if read_stdin else ""
    return _module(
        f"""{_data(1024, text)}
        (func (export "_start") {read}
          (call $write (i32.const 1) (i32.const 1024) (i32.const {len(text.encode())})))"""
    )


def trap() -> str:
    """Traps on ``unreachable`` (far below any memory limit)."""
    return _module('(func (export "_start") unreachable)')


def exit_code(code: int, stderr: str) -> str:
    """Writes ``stderr`` on stderr, then exits with ``code``."""
    return _module(
        f"""{_data(1024, stderr)}
        (func (export "_start")
          (call $write (i32.const 2) (i32.const 1024) (i32.const {len(stderr.encode())}))
          (call $proc_exit (i32.const {code})))"""
    )


def spin() -> str:
    """Loops forever (fuel or the wall-time limit ends it)."""
    return _module('(func (export "_start") (loop $l (br $l)))')


def big_memory(pages: int) -> str:
    """Declares ``pages`` pages (64 KiB each) of initial memory."""
    return _module('(func (export "_start"))', pages=pages)


def grow_until_refused() -> str:
    """Grows its memory by 1 MiB until refused, then traps (as an allocator's abort)."""
    return _module(
        """(func (export "_start")
             (loop $l (br_if $l (i32.ne (memory.grow (i32.const 16)) (i32.const -1))))
             unreachable)"""
    )


def flood(fd: int = 1) -> str:
    """Writes 16-byte chunks on ``fd`` forever, ignoring errors."""
    return _module(
        f"""{_data(1024, '"xxxxxxxxxxxxxx"')}
        (func (export "_start")
          (loop $l (call $write (i32.const {fd}) (i32.const 1024) (i32.const 16)) (br $l)))"""
    )


def sockets() -> str:
    """Tries to accept a connection on every descriptor 0-63 and to send on every one
    from 3 (stdio's writes are the protocol's); writes how many of those succeeded (a
    digit, 9 for more): 0 for a module that has no socket."""
    imports = f"""
  (import "{_WASI}" "sock_accept" (func $sock_accept (param i32 i32 i32) (result i32)))
  (import "{_WASI}" "sock_send" (func $sock_send (param i32 i32 i32 i32 i32) (result i32)))"""
    return _module(
        """(func (export "_start")
          (local $fd i32) (local $ok i32)
          (i32.store (i32.const 32) (i32.const 1024))
          (i32.store (i32.const 36) (i32.const 1))
          (block $done
            (loop $next
              (br_if $done (i32.ge_u (local.get $fd) (i32.const 64)))
              (if (i32.eqz (call $sock_accept (local.get $fd) (i32.const 0) (i32.const 40)))
                (then (local.set $ok (i32.add (local.get $ok) (i32.const 1)))))
              (if (i32.ge_u (local.get $fd) (i32.const 3))
                (then
                  (if (i32.eqz (call $sock_send (local.get $fd) (i32.const 32) (i32.const 1)
                                 (i32.const 0) (i32.const 44)))
                    (then (local.set $ok (i32.add (local.get $ok) (i32.const 1)))))))
              (local.set $fd (i32.add (local.get $fd) (i32.const 1)))
              (br $next)))
          (i32.store8 (i32.const 48)
            (i32.add (i32.const 48)
              (select (local.get $ok) (i32.const 9) (i32.lt_u (local.get $ok) (i32.const 10)))))
          (call $write (i32.const 1) (i32.const 48) (i32.const 1)))""",
        extra=imports,
    )


# path_open flags (WASI preview 1)
SYMLINK_FOLLOW = 1
O_CREAT_TRUNC = 1 | 8
RIGHT_FD_READ = 1 << 1
RIGHT_FD_WRITE = 1 << 6
_ERRNO_OUT = '{"errno":"00"}'


def file_probe(path: str, *, write: bool = False, follow: bool = True) -> str:
    """Opens ``path`` beneath the first preopen (fd 3). Reading: writes the file's
    contents on stdout (tests make them a JSON value). Writing: creates the file with
    ``{"written":true}`` and writes the same on stdout. When the open fails:
    ``{"errno":"NN"}``, the WASI errno in two digits."""
    oflags = O_CREAT_TRUNC if write else 0
    rights = RIGHT_FD_WRITE if write else RIGHT_FD_READ
    written = '{"written":true}'
    after_open = (
        f"""(call $write (i32.load (i32.const 64)) (i32.const 900) (i32.const {len(written)}))
            (call $write (i32.const 1) (i32.const 900) (i32.const {len(written)}))"""
        if write
        else """(i32.store (i32.const 16) (i32.const 65536))
            (i32.store (i32.const 20) (i32.const 4096))
            (drop (call $fd_read (i32.load (i32.const 64)) (i32.const 16) (i32.const 1)
                                 (i32.const 24)))
            (call $write (i32.const 1) (i32.const 65536) (i32.load (i32.const 24)))"""
    )
    extra = f"""
      (import "{_WASI}" "path_open" (func $path_open
        (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))"""
    encoded = path.encode()
    return _module(
        f"""{_data(1024, path)} {_data(800, _ERRNO_OUT)} {_data(900, written)}
        (func (export "_start") (local $err i32)
          (local.set $err (call $path_open (i32.const 3) (i32.const {SYMLINK_FOLLOW if follow else 0})
            (i32.const 1024) (i32.const {len(encoded)}) (i32.const {oflags})
            (i64.const {rights}) (i64.const 0) (i32.const 0) (i32.const 64)))
          (if (local.get $err)
            (then
              (i32.store8 (i32.const 810) (i32.add (i32.const 48)
                (i32.div_u (local.get $err) (i32.const 10))))
              (i32.store8 (i32.const 811) (i32.add (i32.const 48)
                (i32.rem_u (local.get $err) (i32.const 10))))
              (call $write (i32.const 1) (i32.const 800) (i32.const {len(_ERRNO_OUT)}))
              (return)))
          {after_open})""",
        extra=extra,
    )


def environment() -> str:
    """Writes its environment as ``{"env":"NAME=value NAME=value "}`` (values the tests
    choose: no quotes or backslashes)."""
    extra = f"""
      (import "{_WASI}" "environ_sizes_get" (func $sizes (param i32 i32) (result i32)))
      (import "{_WASI}" "environ_get" (func $environ (param i32 i32) (result i32)))"""
    return _module(
        f"""{_data(1000, '{"env":"')} {_data(1010, '"}')}
        (func (export "_start") (local $i i32) (local $n i32)
          (drop (call $sizes (i32.const 32) (i32.const 36)))
          (drop (call $environ (i32.const 2048) (i32.const 65536)))
          (local.set $n (i32.load (i32.const 36)))
          (block $done (loop $l
            (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
            (if (i32.eqz (i32.load8_u (i32.add (i32.const 65536) (local.get $i))))
              (then (i32.store8 (i32.add (i32.const 65536) (local.get $i)) (i32.const 32))))
            (local.set $i (i32.add (local.get $i) (i32.const 1)))
            (br $l)))
          (call $write (i32.const 1) (i32.const 1000) (i32.const 8))
          (call $write (i32.const 1) (i32.const 65536) (local.get $n))
          (call $write (i32.const 1) (i32.const 1010) (i32.const 2)))""",
        extra=extra,
    )


def model_request(request: str) -> str:
    """Sends ``request`` (model.chat's arguments as JSON) through ``cogni.model_chat``
    and writes the answer it reads back with ``cogni.response_read`` on stdout."""
    extra = """
      (import "cogni" "model_chat" (func $model_chat (param i32 i32) (result i32)))
      (import "cogni" "response_read" (func $response_read (param i32 i32) (result i32)))"""
    return _module(
        f"""{_data(1024, request)}
        (func (export "_start")
          (drop (call $model_chat (i32.const 1024) (i32.const {len(request.encode())})))
          (call $write (i32.const 1) (i32.const 65536)
            (call $response_read (i32.const 65536) (i32.const 65536))))""",
        extra=extra,
    )
