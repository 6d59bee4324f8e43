"""A run's network namespace, probed from inside with real processes.

Each property is proven by a process that joins the namespace (``nsenter --net=PATH``)
and tries: loopback-only, no host loopback, no outside address, its own loopback works.
Every test uses fresh run ids and removes what it made in ``finally``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from gatewayd.sandbox.netns import (
    NAME_MAX,
    NETNS_PREFIX,
    NETNS_RUN_DIR,
    NetnsError,
    NetnsHandle,
    create_run_netns,
    netns_name,
    remove_run_netns,
    remove_stale_netns,
    stale_netns,
)

# TEST-NET-2 (RFC 5737): documentation space, never routed anywhere.
OUTSIDE_V4 = "198.51.100.1"
PROBE_TIMEOUT_S = 20


def _unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN); these tests run as root"
    for tool in ("nsenter", "ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} (util-linux / iproute2) is not installed"
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"this kernel or container refuses new network namespaces: {probe.stderr.strip()}"
    return None


_REASON = _unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@pytest.fixture
def run_netns() -> Iterator[NetnsHandle]:
    handle = create_run_netns(secrets.token_hex(16))
    try:
        yield handle
    finally:
        remove_run_netns(handle.name)


def inside(handle: NetnsHandle, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as a process that has joined the namespace."""
    return subprocess.run(
        ["nsenter", f"--net={handle.path}", *argv],
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
        check=True,
    )


def probe(handle: NetnsHandle, code: str) -> Any:
    """Run python ``code`` inside the namespace; it prints one JSON value."""
    return json.loads(inside(handle, sys.executable, "-c", textwrap.dedent(code)).stdout)


def ip_netns_list() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def pinned() -> set[str]:
    return set(os.listdir(NETNS_RUN_DIR)) if NETNS_RUN_DIR.exists() else set()


# --- names and input validation ------------------------------------------------------


def test_name_is_the_prefix_followed_by_the_run_id_and_fits_a_file_name() -> None:
    run_id = secrets.token_hex(16)
    assert netns_name(run_id) == "cogni-" + run_id
    assert NETNS_PREFIX == "cogni-"
    assert netns_name(run_id, prefix="cgx-") == "cgx-" + run_id
    assert len(netns_name(run_id, prefix="a" * 63 + "-")) <= NAME_MAX


@pytest.mark.parametrize(
    "bad_run_id",
    [
        "../x",
        "../" + "a" * 29,  # 32 characters, but a path
        "a" * 16 + "/../../../../tmp",
        "A" * 32,  # uppercase
        "0123456789ABCDEF0123456789abcdef",
        "a" * 31,
        "a" * 33,
        "",
        "g" * 32,  # not hex
        "a" * 31 + "\n",
        "a" * 31 + "\x00",
    ],
)
def test_invalid_run_ids_are_refused_before_anything_touches_the_system(
    bad_run_id: str,
) -> None:
    before = pinned()
    with pytest.raises(ValueError, match="exactly 32 lowercase hex digits") as info:
        create_run_netns(bad_run_id)
    assert repr(bad_run_id) in str(info.value)
    assert pinned() == before
    assert not Path("/run/x").exists()
    with pytest.raises(ValueError, match="exactly 32 lowercase hex digits"):
        netns_name(bad_run_id)


@given(
    st.text(max_size=40).filter(lambda s: not (len(s) == 32 and set(s) <= set("0123456789abcdef")))
)
def test_any_run_id_that_is_not_32_lowercase_hex_is_refused(bad_run_id: str) -> None:
    with pytest.raises(ValueError, match="exactly 32 lowercase hex digits"):
        netns_name(bad_run_id)


@pytest.mark.parametrize(
    "bad_prefix", ["", "cogni", "Cogni-", "../", "-x-", "a/b-", "a" * 64 + "-"]
)
def test_invalid_prefixes_are_refused_with_what_is_allowed(bad_prefix: str) -> None:
    with pytest.raises(ValueError, match="lowercase letters, digits and '-'"):
        netns_name(secrets.token_hex(16), prefix=bad_prefix)
    with pytest.raises(ValueError, match="lowercase letters, digits and '-'"):
        stale_netns(bad_prefix)


def test_remove_refuses_a_name_that_is_not_a_runs_and_leaves_the_file_alone() -> None:
    victim = Path("/tmp") / f"cg-victim-{secrets.token_hex(4)}"
    victim.write_text("keep me")
    try:
        for bad in (
            f"../../tmp/{victim.name}",
            str(victim),
            "cg-test-other-x",
            "cogni-" + "0" * 31,
            "..",
        ):
            with pytest.raises(ValueError, match="<prefix><run id>"):
                remove_run_netns(bad)
        assert victim.read_text() == "keep me"
    finally:
        victim.unlink()


# --- what a process inside sees ------------------------------------------------------


def test_created_namespace_is_pinned_and_listed_under_its_name(run_netns: NetnsHandle) -> None:
    assert run_netns.path == Path("/run/netns") / run_netns.name
    assert run_netns.path.exists()
    assert run_netns.name in ip_netns_list()


def test_inside_only_lo_exists_and_it_is_up_with_loopback_addresses(
    run_netns: NetnsHandle,
) -> None:
    # `ip` speaks netlink from inside the namespace: a second tool, not the one that built it.
    links = json.loads(inside(run_netns, "ip", "-j", "addr", "show").stdout)
    assert [link["ifname"] for link in links] == ["lo"]
    (lo,) = links
    assert "UP" in lo["flags"] and "LOOPBACK" in lo["flags"]
    addresses = {(a["local"], a["prefixlen"]) for a in lo["addr_info"]}
    assert ("127.0.0.1", 8) in addresses
    assert addresses <= {("127.0.0.1", 8), ("::1", 128)}
    # The same from the socket API: one interface, and it is lo.
    assert probe(run_netns, "import json, socket; print(json.dumps(socket.if_nameindex()))") == [
        [1, "lo"]
    ]
    routes = json.loads(inside(run_netns, "ip", "-j", "route", "show").stdout)
    assert routes == []  # no default route, no route anywhere


def test_host_loopback_service_is_refused_from_inside(run_netns: NetnsHandle) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        # Control: the service answers on the host's loopback.
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        result = probe(
            run_netns,
            f"""
            import json, socket
            s = socket.socket()
            s.settimeout(5)
            try:
                s.connect(("127.0.0.1", {port}))
                print(json.dumps("connected"))
            except OSError as e:
                print(json.dumps(e.errno))
            """,
        )
    assert result == errno.ECONNREFUSED


def test_outside_addresses_are_unreachable_from_inside_tcp_and_udp(
    run_netns: NetnsHandle,
) -> None:
    targets = [OUTSIDE_V4]
    host_address = _host_outward_address()
    if host_address is not None:
        targets.append(host_address)  # the host itself, through its own interface
    result = probe(
        run_netns,
        f"""
        import json, socket
        out = {{}}
        for host in {targets!r}:
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                u.sendto(b"x", (host, 53))
                out["udp " + host] = "sent"
            except OSError as e:
                out["udp " + host] = e.errno
            t = socket.socket()
            t.settimeout(5)
            try:
                t.connect((host, 80))
                out["tcp " + host] = "connected"
            except OSError as e:
                out["tcp " + host] = e.errno
        print(json.dumps(out))
        """,
    )
    assert result == {
        f"{proto} {host}": errno.ENETUNREACH for host in targets for proto in ("udp", "tcp")
    }


def test_loopback_inside_the_namespace_works(run_netns: NetnsHandle) -> None:
    result = probe(
        run_netns,
        """
        import json, socket
        with socket.create_server(("127.0.0.1", 0)) as server:
            client = socket.create_connection(server.getsockname(), timeout=5)
            conn, _ = server.accept()
            client.sendall(b"ping")
            print(json.dumps(conn.recv(4).decode()))
        """,
    )
    assert result == "ping"


# --- lifecycle -----------------------------------------------------------------------


def test_creating_an_existing_namespace_is_refused_as_a_leftover_and_left_in_place(
    run_netns: NetnsHandle,
) -> None:
    with pytest.raises(NetnsError, match="already exists") as info:
        create_run_netns(run_netns.run_id)
    assert info.value.name == run_netns.name
    assert "remove_stale_netns" in str(info.value)
    assert run_netns.path.exists()
    assert run_netns.name in ip_netns_list()


def test_removal_takes_the_name_out_of_ip_netns_list_and_run_netns_and_is_idempotent() -> None:
    handle = create_run_netns(secrets.token_hex(16))
    try:
        assert remove_run_netns(handle.name) is True
        assert handle.name not in ip_netns_list()
        assert handle.name not in pinned()
        assert not handle.path.exists()
        assert remove_run_netns(handle.name) is False
    finally:
        remove_run_netns(handle.name)


def test_stale_cleanup_removes_our_leftovers_and_nothing_else() -> None:
    # A prefix of our own, so this test never touches another daemon's live namespaces.
    prefix = f"cgt{secrets.token_hex(4)}-"
    other = f"cg-test-other-{secrets.token_hex(4)}"
    ours_but_not_a_run = prefix + "notarunid"
    leftovers = [create_run_netns(secrets.token_hex(16), prefix=prefix) for _ in range(2)]
    try:
        for name in (other, ours_but_not_a_run):
            subprocess.run(["ip", "netns", "add", name], check=True)
        expected = sorted(h.name for h in leftovers)
        assert stale_netns(prefix) == expected
        assert remove_stale_netns(prefix) == expected
        listed = ip_netns_list()
        assert not listed & set(expected)
        assert not pinned() & set(expected)
        assert {other, ours_but_not_a_run} <= listed
        assert remove_stale_netns(prefix) == []
    finally:
        for handle in leftovers:
            remove_run_netns(handle.name)
        for name in (other, ours_but_not_a_run):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


async def test_daemon_can_create_and_remove_from_trio_worker_threads_concurrently() -> None:
    run_ids = [secrets.token_hex(16) for _ in range(4)]
    handles: dict[str, NetnsHandle] = {}

    async def create(run_id: str) -> None:
        handles[run_id] = await trio.to_thread.run_sync(create_run_netns, run_id)

    try:
        async with trio.open_nursery() as nursery:
            for run_id in run_ids:
                nursery.start_soon(create, run_id)
        assert {h.name for h in handles.values()} <= ip_netns_list()
        async with trio.open_nursery() as nursery:
            for handle in handles.values():
                nursery.start_soon(trio.to_thread.run_sync, remove_run_netns, handle.name)
        assert not {h.name for h in handles.values()} & ip_netns_list()
    finally:
        for run_id in run_ids:
            remove_run_netns(netns_name(run_id))


def test_without_privilege_creation_fails_with_an_operator_message_and_leaves_nothing() -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to drop to an unprivileged user")
    run_id = secrets.token_hex(16)
    code = f"""
        from gatewayd.sandbox.netns import NetnsError, create_run_netns
        try:
            create_run_netns({run_id!r})
            print("created")
        except NetnsError as e:
            print(e)
        """
    try:
        # Really unprivileged: uid nobody, no capabilities.
        out = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                sys.executable,
                "-c",
                textwrap.dedent(code),
            ],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            cwd=Path(__file__).resolve().parents[2],
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
        if out.returncode != 0 and "Permission denied" in out.stderr:
            pytest.skip(f"python cannot start as uid nobody here: {out.stderr.strip()[-200:]}")
        message = out.stdout.strip()
        assert netns_name(run_id) in message, out.stderr
        assert "EPERM" in message and "needs CAP_SYS_ADMIN" in message
        assert netns_name(run_id) not in pinned()
    finally:
        remove_run_netns(netns_name(run_id))


def _host_outward_address() -> str | None:
    """The host's own source address toward the outside, if it has a route there."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, contextlib.suppress(OSError):
        s.connect((OUTSIDE_V4, 9))  # UDP connect sends nothing; it only picks a route
        address: str = s.getsockname()[0]
        return address
    return None


# --- pyroute2's forked helper and gatewayd's signal handlers --------------------------

_STUCK_HANDLER_SCRIPT = """
import signal, sys, threading
from gatewayd.sandbox.netns import create_run_netns, remove_run_netns

# gatewayd's Python handlers (trio's) are inherited by pyroute2's forked helper; this one
# waits forever, as trio's does on a lock another thread held at the fork.
signal.signal(signal.SIGTERM, lambda *_: threading.Event().wait())
prefix, count = sys.argv[1], int(sys.argv[2])
for i in range(count):
    handle = create_run_netns(f"{i:032x}", prefix=prefix)
    remove_run_netns(handle.name)
print("created and removed", count)
"""


def test_a_python_sigterm_handler_never_hangs_the_namespace_helper(tmp_path: Path) -> None:
    # pyroute2 SIGTERMs its helper once it has answered: with the handler run there, the
    # helper never exits and the run's creation waits for it forever.
    prefix = f"cgsig{secrets.token_hex(2)}-"
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUCK_HANDLER_SCRIPT, prefix, "5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the script and its stuck helpers
        out, err = proc.communicate()
        pytest.fail(f"creating a namespace hung on the helper's SIGTERM handler: {err[-2000:]}")
    finally:
        for name in stale_netns(prefix):
            remove_run_netns(name)
    assert proc.returncode == 0, err[-2000:]
    assert "created and removed 5" in out
