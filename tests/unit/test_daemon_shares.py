"""The pure rules that keep two daemons on one host apart: the defaults derived from the
state directory, which namespaces a start sweeps, when uid ranges overlap, and when two
daemons' shares clash (gatewayd/sandbox/daemons.py). The registry itself, on real files
and processes: tests/integration/test_daemons_on_one_host.py."""

from __future__ import annotations

import itertools
import json
import secrets
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatewayd import cli
from gatewayd.cli import command as cli_command
from gatewayd.cli import options as cli_options
from gatewayd.config import ConfigError, GatewaydConfig, SandboxUids
from gatewayd.configsources import DERIVED_SOURCE, resolve_settings
from gatewayd.sandbox.daemons import (
    PREFIX_HASH_HEX,
    DaemonShare,
    clash_message,
    clashes,
    derived_netns_prefix,
    derived_uid_range,
)
from gatewayd.sandbox.netns import (
    MAX_PREFIX_LENGTH,
    NETNS_PREFIX,
    RUN_ID_LENGTH,
    netns_name,
    prefixes_clash,
    sweeps,
)
from gatewayd.sandbox.uids import (
    CONTAINER_UID_FIRST,
    CONTAINER_UID_LAST,
    DEFAULT_UID_COUNT,
    UidRange,
)

# A fixed sample of state directories as tests and operators name them.
SAMPLE = [Path(f"/tmp/cg-{i:04x}/state") for i in range(150)] + [
    Path("/var/lib/gatewayd"),
    Path("/var/lib/gatewayd2"),
    Path("/srv/gatewayd"),
    Path("/srv/gw"),
    Path("/"),
]

# --- the derived defaults --------------------------------------------------------------


@pytest.mark.parametrize("state_dir", SAMPLE[:5] + SAMPLE[-5:])
def test_a_derived_prefix_is_a_valid_prefix_named_after_the_state_dir(state_dir: Path) -> None:
    prefix = derived_netns_prefix(state_dir)
    assert prefix.startswith(NETNS_PREFIX) and prefix.endswith("-")
    digest = prefix.removeprefix(NETNS_PREFIX).removesuffix("-")
    assert len(digest) == PREFIX_HASH_HEX and int(digest, 16) >= 0
    netns_name("0" * RUN_ID_LENGTH, prefix=prefix)  # the validator takes it
    assert derived_netns_prefix(Path(str(state_dir))) == prefix  # the same every time


def test_every_state_dir_of_the_sample_gets_its_own_prefix_and_uid_range() -> None:
    prefixes = [derived_netns_prefix(d) for d in SAMPLE]
    assert len(set(prefixes)) == len(SAMPLE)
    ranges = [derived_uid_range(d) for d in SAMPLE]
    overlapping = [(a, b) for a, b in itertools.combinations(ranges, 2) if a.overlaps(b)]
    assert overlapping == []


@pytest.mark.parametrize("count", [1, 8, DEFAULT_UID_COUNT, 65536])
def test_a_derived_uid_range_lies_in_the_container_range_at_a_multiple_of_its_count(
    count: int,
) -> None:
    for state_dir in SAMPLE:
        uids = derived_uid_range(state_dir, count)
        assert uids.count == count
        assert uids.base >= CONTAINER_UID_FIRST
        assert uids.base + uids.count - 1 <= CONTAINER_UID_LAST
        assert (uids.base - CONTAINER_UID_FIRST) % count == 0
        assert derived_uid_range(state_dir, count) == uids


def test_the_old_shared_default_prefix_sweeps_no_derived_namespace() -> None:
    """A daemon still set to the old default ``cogni-`` removes none of the namespaces
    of a daemon with a derived prefix, and the other way round."""
    run_id = secrets.token_hex(16)
    for state_dir in SAMPLE:
        derived = derived_netns_prefix(state_dir)
        assert not sweeps(NETNS_PREFIX, netns_name(run_id, prefix=derived))
        assert not sweeps(derived, netns_name(run_id, prefix=NETNS_PREFIX))


@pytest.mark.parametrize("count", [0, -1, CONTAINER_UID_LAST - CONTAINER_UID_FIRST + 2])
def test_a_count_that_cannot_be_placed_is_refused_with_the_limit(count: int) -> None:
    with pytest.raises(ValueError, match=r"cannot be placed in systemd's container uid range"):
        derived_uid_range(Path("/srv/gw"), count)
    with pytest.raises(
        ValueError, match=rf"give 1\.\.{CONTAINER_UID_LAST - CONTAINER_UID_FIRST + 1}"
    ):
        derived_uid_range(Path("/srv/gw"), count)


# --- which namespaces a start sweeps -------------------------------------------------------

prefixes = st.from_regex(r"[a-z][a-z0-9-]{0,30}-", fullmatch=True)
run_ids = st.binary(min_size=16, max_size=16).map(bytes.hex)


@given(mine=prefixes, theirs=prefixes, run_id=run_ids)
def test_a_start_sweeps_another_daemons_namespace_exactly_when_the_prefixes_clash(
    mine: str, theirs: str, run_id: str
) -> None:
    name = netns_name(run_id, prefix=theirs)
    assert sweeps(mine, name) == prefixes_clash(mine, theirs) == (mine == theirs)


@pytest.mark.parametrize(
    ("mine", "theirs"),
    [
        ("cogni-", "cogni-1a2b3c4d-"),  # one prefix starts the other
        ("a-", "a-b-"),
        ("cogni-", "cogni-" + "0" * 31 + "-"),
        ("a" * (MAX_PREFIX_LENGTH - 1) + "-", "a" * (MAX_PREFIX_LENGTH - 2) + "-"),
    ],
)
def test_a_prefix_that_begins_another_does_not_sweep_its_namespaces(mine: str, theirs: str) -> None:
    run_id = secrets.token_hex(16)
    assert not prefixes_clash(mine, theirs) and not prefixes_clash(theirs, mine)
    assert not sweeps(mine, netns_name(run_id, prefix=theirs))
    assert not sweeps(theirs, netns_name(run_id, prefix=mine))


@pytest.mark.parametrize(
    "name",
    ["cogni-", "cogni-" + "0" * 31, "cogni-" + "0" * 33, "cogni-" + "G" * 32, "x-" + "0" * 32],
)
def test_a_start_sweeps_only_its_prefix_and_a_run_id(name: str) -> None:
    assert not sweeps("cogni-", name)


def test_an_invalid_prefix_is_refused_by_the_clash_rule() -> None:
    with pytest.raises(ValueError, match="lowercase letters, digits and '-'"):
        prefixes_clash("cogni-", "../")
    with pytest.raises(ValueError, match="derives one from its state directory"):
        sweeps("Cogni-", "Cogni-" + "0" * 32)


# --- uid ranges --------------------------------------------------------------------------

BASE = 1_700_000_000


@pytest.mark.parametrize(
    ("other", "overlap"),
    [
        (UidRange(BASE, 64), True),  # the same
        (UidRange(BASE + 16, 8), True),  # inside
        (UidRange(BASE - 64, 256), True),  # around
        (UidRange(BASE - 8, 9), True),  # its first uid
        (UidRange(BASE + 63, 1), True),  # its last uid
        (UidRange(BASE + 32, 64), True),  # straddling its end
        (UidRange(BASE - 8, 8), False),  # just below
        (UidRange(BASE + 64, 8), False),  # just above
        (UidRange(BASE + 1_000_000, 64), False),
    ],
)
def test_uid_ranges_overlap_when_they_share_a_uid(other: UidRange, overlap: bool) -> None:
    mine = UidRange(BASE, 64)
    assert mine.overlaps(other) is overlap
    assert other.overlaps(mine) is overlap
    shared = {uid for uid in range(other.base, other.base + other.count) if uid in mine}
    assert bool(shared) is overlap


# --- when two daemons clash ---------------------------------------------------------------


def share(state: str, *, agent: str | None = None, **changes: Any) -> DaemonShare:
    values: dict[str, Any] = {
        "state_dir": Path(state),
        "agent_dir": Path(agent or f"{state}-agent"),
        "netns_prefix": derived_netns_prefix(Path(state)),
        "uids": derived_uid_range(Path(state)),
        "pid": 4242,
    }
    values.update(changes)
    return DaemonShare(**values)


LIVE = share("/srv/a")
CLASHES = [
    # (the starting daemon, a phrase of each reason it is refused for)
    (share("/srv/a"), ["is its state directory /srv/a", "--state-dir (state_dir)"]),
    (share("/srv/a/runs/x"), ["overlaps its state directory /srv/a"]),
    (share("/srv"), ["state directory /srv overlaps its state directory /srv/a"]),
    (share("/srv/a-agent/x"), ["overlaps its agent_dir /srv/a-agent"]),
    (share("/srv/b", agent="/srv/a/runs"), ["agent_dir /srv/a/runs overlaps its state"]),
    (
        share("/srv/b", netns_prefix=LIVE.netns_prefix),
        [f"network-namespace prefix {LIVE.netns_prefix!r}", "--netns-prefix (netns_prefix"],
    ),
    (
        share("/srv/b", uids=UidRange(LIVE.uids.base + 1000, 100) if LIVE.uids else None),
        ["overlap its", "--sandbox-uids (sandbox_uids)", "derived from the state directory"],
    ),
]


# A live daemon with its audit log and control socket registered.
SERVING = share(
    "/srv/a", audit_path=Path("/var/log/a/audit.jsonl"), control_socket=Path("/run/a.sock")
)
AUDIT_SETTING = "give this daemon another --audit (audit_path)"
SOCKET_SETTING = "give this daemon another --control-socket (control_socket)"
FILE_CLASHES = [
    (
        share("/srv/b", audit_path=Path("/var/log/a/audit.jsonl")),
        ["is its audit log", AUDIT_SETTING],
    ),
    # The head file and the closed segments are the log's too: written to, or rotated over.
    (
        share("/srv/b", audit_path=Path("/var/log/a/audit.jsonl.head")),
        ["shares a file", AUDIT_SETTING],
    ),
    (
        share("/srv/b", audit_path=Path("/var/log/a/audit.jsonl.000003")),
        ["audit.jsonl.NNNNNN", AUDIT_SETTING],
    ),
    (
        share("/srv/b", control_socket=Path("/run/a.sock")),
        ["is its control socket", SOCKET_SETTING],
    ),
    (
        share("/srv/b", control_socket=Path("/var/log/a/audit.jsonl")),
        [
            "is a file of its audit log /var/log/a/audit.jsonl, which the socket would replace",
            SOCKET_SETTING,
        ],
    ),
    (
        share("/srv/b", control_socket=Path("/var/log/a/audit.jsonl.head")),
        ["which the socket would replace"],
    ),
    (
        share("/srv/b", audit_path=Path("/run/a.sock")),
        ["would be written at its control socket /run/a.sock", AUDIT_SETTING],
    ),
    # Beneath the other's runs/: that daemon's (next) start removes the directory.
    (
        share("/srv/b", control_socket=Path("/srv/a/runs/x/c.sock")),
        ["lies in a directory of its /srv/a/runs", SOCKET_SETTING],
    ),
    (
        share("/srv/b", audit_path=Path("/srv/a/runs/x/audit.jsonl")),
        ["which that daemon's next start would remove", AUDIT_SETTING],
    ),
]


@pytest.mark.parametrize(("starting", "phrases"), FILE_CLASHES)
def test_a_share_that_would_take_the_live_ones_audit_log_or_control_socket_is_a_clash(
    starting: DaemonShare, phrases: list[str]
) -> None:
    reasons = clashes(starting, SERVING)
    assert reasons
    for phrase in phrases:
        assert any(phrase in reason for reason in reasons), (phrase, reasons)


@pytest.mark.parametrize("suffix", [".head", ".000001"])
def test_a_log_whose_own_head_file_or_segment_is_the_live_ones_log_is_a_clash(
    suffix: str,
) -> None:
    live = share("/srv/a", audit_path=Path(f"/var/log/a/b.jsonl{suffix}"))
    reasons = clashes(share("/srv/b", audit_path=Path("/var/log/a/b.jsonl")), live)
    assert any(AUDIT_SETTING in reason for reason in reasons), reasons


def test_a_live_daemons_audit_log_or_socket_beneath_this_ones_runs_is_a_clash() -> None:
    live = share(
        "/srv/a",
        audit_path=Path("/srv/b/runs/x/audit.jsonl"),
        control_socket=Path("/srv/b/runs/y/c.sock"),
    )
    reasons = clashes(share("/srv/b", audit_path=Path("/srv/b/audit/audit.jsonl")), live)
    for what in ("audit log /srv/b/runs/x/audit.jsonl", "control socket /srv/b/runs/y/c.sock"):
        assert any(
            f"its {what} lies in a directory of this daemon's /srv/b/runs" in r for r in reasons
        ), reasons
    assert all("--state-dir (state_dir)" in r for r in reasons)


@pytest.mark.parametrize(
    "starting",
    [
        share(
            "/srv/b",
            audit_path=Path("/var/log/a/audit-b.jsonl"),
            control_socket=Path("/run/b.sock"),
        ),
        share("/srv/b", audit_path=Path("/var/log/a/audit.jsonl.old")),  # no file in common
        share("/srv/b", audit_path=Path("/var/log/b/audit.jsonl")),
        share("/srv/b"),  # an entry of an older gatewayd: nothing registered to compare
    ],
)
def test_audit_logs_and_sockets_with_no_file_in_common_do_not_clash(starting: DaemonShare) -> None:
    assert clashes(starting, SERVING) == []
    assert clashes(SERVING, starting) == []


@pytest.mark.parametrize(("starting", "phrases"), CLASHES)
def test_a_share_that_would_sweep_or_reuse_the_live_ones_is_a_clash(
    starting: DaemonShare, phrases: list[str]
) -> None:
    reasons = clashes(starting, LIVE)
    assert reasons
    for phrase in phrases:
        assert any(phrase in reason for reason in reasons), (phrase, reasons)
    message = clash_message(LIVE, reasons)
    assert message.startswith("another gatewayd is running on this host (pid 4242, state ")
    assert message.endswith("This daemon did not start and touched nothing")


@pytest.mark.parametrize(
    "starting",
    [
        share("/srv/b"),  # defaults derived from another state directory
        share("/srv/b", agent="/srv/a-agent"),  # a shared agent_dir is lock-protected
        share("/srv/ab"),  # a name that starts with the other's is not inside it
        share("/srv/b", netns_prefix=None, uids=None),  # no OS sandbox: no namespace, no uid
        share("/srv/b", uids=UidRange(LIVE.uids.base + LIVE.uids.count, 8) if LIVE.uids else None),
    ],
)
def test_shares_that_cannot_break_each_other_do_not_clash(starting: DaemonShare) -> None:
    assert clashes(starting, LIVE) == []
    assert clashes(LIVE, starting) == []


def test_a_daemon_without_the_os_sandbox_still_clashes_on_its_state_dir() -> None:
    starting = share("/srv/a", netns_prefix=None, uids=None)
    assert [r for r in clashes(starting, LIVE) if "--state-dir" in r]
    assert not [r for r in clashes(starting, LIVE) if "--netns-prefix" in r]


def test_an_entry_reads_back_as_the_share_it_was_written_from() -> None:
    for one in (LIVE, SERVING, share("/srv/b", netns_prefix=None, uids=None)):
        assert DaemonShare.from_json(json.loads(json.dumps(one.to_json()))) == one


def test_an_entry_of_a_gatewayd_that_registered_no_files_reads_without_them() -> None:
    older = {k: v for k, v in SERVING.to_json().items() if k not in ("auditPath", "controlSocket")}
    parsed = DaemonShare.from_json(older)
    assert (parsed.audit_path, parsed.control_socket) == (None, None)
    assert parsed.state_dir == SERVING.state_dir


def test_the_registered_share_holds_the_real_paths_of_the_audit_log_and_control_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever way the paths are given (a symlinked directory, a symlink to the file, a
    path with ``..`` as a relative option gives it), the registry compares where they
    really lead."""
    real = tmp_path / "real"
    (real / "audit").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(real)
    (tmp_path / "sock-link").symlink_to(real / "control.sock")
    monkeypatch.chdir(real / "audit")
    config = GatewaydConfig(
        state_dir=tmp_path / "alias" / "state",
        audit_path=Path("../audit/./audit.jsonl").absolute(),  # as `--audit` takes it
    )
    shared = config.host_share(control_socket=tmp_path / "sock-link")
    assert shared.state_dir == real / "state"
    assert shared.audit_path == real / "audit" / "audit.jsonl"
    assert shared.control_socket == real / "control.sock"
    alone = GatewaydConfig(state_dir=real / "state")
    assert alone.host_share(control_socket=None).control_socket is None
    assert GatewaydConfig(state_dir=tmp_path / "alias").host_share(
        control_socket=None
    ).audit_path == (real / "audit" / "audit.jsonl")


@pytest.mark.parametrize(
    "data",
    [
        [],
        {},
        {**LIVE.to_json(), "pid": "4242"},
        {**LIVE.to_json(), "uids": [1]},
        {**LIVE.to_json(), "uids": [10, 1]},  # not a usable range
        {**LIVE.to_json(), "stateDir": 5},
        {**LIVE.to_json(), "netnsPrefix": ["x"]},
        {**LIVE.to_json(), "auditPath": 5},
        {**LIVE.to_json(), "controlSocket": ["/run/a.sock"]},
    ],
)
def test_a_malformed_entry_is_a_value_error(data: Any) -> None:
    with pytest.raises(ValueError):
        DaemonShare.from_json(data)


# --- the configuration shows and the daemon uses the same derived values ----------------


def test_unset_prefix_and_uids_are_derived_from_the_state_dir_and_shown_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GATEWAYD_CONFIG", raising=False)
    state = tmp_path / "state"
    assert cli.main(["config", "show", "--json", "--state-dir", str(state)]) == cli_command.EXIT_OK
    shown = json.loads(capsys.readouterr().out)["settings"]
    uids = derived_uid_range(state)
    assert shown["netns_prefix"] == {"value": derived_netns_prefix(state), "source": DERIVED_SOURCE}
    assert shown["sandbox_uids"] == {
        "value": {"base": uids.base, "count": uids.count},
        "source": DERIVED_SOURCE,
    }
    assert cli.main(["config", "show", "--state-dir", str(state)]) == cli_command.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert f"netns_prefix: {derived_netns_prefix(state)}  # {DERIVED_SOURCE}" in lines
    # The daemon these options build uses exactly what was shown.
    daemon = cli_options.config_from_options(
        cli.build_parser().parse_args(["serve", "--state-dir", str(state)])
    )
    assert (daemon.netns_prefix, daemon.sandbox_uids) == (None, None)
    assert daemon.resolved_netns_prefix == derived_netns_prefix(state)
    assert daemon.resolved_sandbox_uids == uids
    assert daemon.host_share(control_socket=None).netns_prefix == derived_netns_prefix(state)


def test_explicit_settings_are_kept_as_given() -> None:
    explicit = resolve_settings(
        file=None,
        environ={"GATEWAYD_NETNS_PREFIX": "gw2-", "GATEWAYD_SANDBOX_UIDS": "1700000000+256"},
    )
    assert explicit.config.resolved_netns_prefix == "gw2-"
    assert explicit.config.resolved_sandbox_uids == UidRange(1_700_000_000, 256)
    assert explicit.sources["netns_prefix"] == "env GATEWAYD_NETNS_PREFIX"
    config = GatewaydConfig(
        netns_prefix="gw2-", sandbox_uids=SandboxUids(base=1_700_000_000, count=256)
    )
    assert (config.resolved_netns_prefix, config.resolved_sandbox_uids) == (
        "gw2-",
        UidRange(1_700_000_000, 256),
    )


def test_a_count_without_a_base_is_placed_by_the_state_dir(tmp_path: Path) -> None:
    path = tmp_path / "gatewayd.yaml"
    path.write_text("state_dir: /srv/gw\nsandbox_uids: {count: 16}\n")
    settings = resolve_settings(file=path, environ={})
    assert settings.config.resolved_sandbox_uids == derived_uid_range(Path("/srv/gw"), 16)
    assert settings.sources["sandbox_uids"] == f"file {path}, base from state_dir"
    daemon = cli_options.config_from_options(
        cli.build_parser().parse_args(["serve", "--config", str(path)])
    )
    assert daemon.resolved_sandbox_uids == derived_uid_range(Path("/srv/gw"), 16)
    path.write_text("sandbox_uids: {base: 1700000000}\n")
    assert resolve_settings(file=path, environ={}).config.resolved_sandbox_uids == UidRange(
        1_700_000_000, DEFAULT_UID_COUNT
    )


def test_a_count_too_big_to_place_is_refused_naming_the_setting(tmp_path: Path) -> None:
    path = tmp_path / "gatewayd.yaml"
    path.write_text("sandbox_uids: {count: 2000000000}\n")
    with pytest.raises(ConfigError, match=r"sandbox_uids: .*count 2000000000 cannot be placed"):
        resolve_settings(file=path, environ={})


def test_the_daemon_takes_the_defaults_the_configuration_derives(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "lnk").symlink_to(tmp_path / "real")
    for state_dir in (Path("/var/lib/gatewayd"), Path("/srv/gw"), tmp_path / "lnk" / "gw"):
        settings = GatewaydConfig(state_dir=state_dir)
        daemon = settings.with_real_dirs()  # what open_daemon builds the daemon from
        assert settings.resolved_netns_prefix == derived_netns_prefix(state_dir)
        assert settings.resolved_sandbox_uids == derived_uid_range(state_dir)
        assert daemon.resolved_netns_prefix == settings.resolved_netns_prefix
        assert daemon.resolved_sandbox_uids == settings.resolved_sandbox_uids
