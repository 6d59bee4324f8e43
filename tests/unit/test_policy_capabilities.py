"""The policy step for every runner kind: a call's requested capabilities against its
tool's declaration and the run's rights (gatewayd/policy/capabilities.py), table-driven.

One row per capability kind and outcome: allowed, refused by the run's rights (with the
exact message dispatch answers), and asked for beyond the tool's declaration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Final

import msgspec
import pytest

from gatewayd.policy import Allow, Deny, PathAccess, PathGrant, PathMode
from gatewayd.policy.capabilities import (
    ANY,
    EVERY_PATH,
    EVERYTHING_ALLOWED,
    NO_CAPABILITIES,
    NO_REQUEST,
    Capabilities,
    CapabilityRequest,
    FileCapability,
    RunRights,
    check_call,
)
from gatewayd.policy.model import NetworkSection
from gatewayd.protocol import ErrorCode
from gatewayd.runs import ModelBudget

WORKSPACE: Final = PathGrant(
    name="workspace",
    host_root=Path("/host/ws"),
    root_id=(1, 10),
    holds_nested=True,
    visible_root=PurePosixPath("/workspace"),
    mode=PathMode.RW,
)
REFERENCE: Final = PathGrant(
    name="reference",
    host_root=Path("/host/ws/reference"),
    root_id=(1, 11),
    holds_nested=False,
    visible_root=PurePosixPath("/workspace/reference"),
    mode=PathMode.RO,
)
NETWORK: Final = NetworkSection(allow_domains=("example.org", "*.corp.example"))


def rights(
    *,
    models: tuple[str, ...] = ("assistant",),
    budget: ModelBudget | None = None,
    network: NetworkSection = NETWORK,
    env: tuple[str, ...] = ("LANG",),
    without_sandbox: str | None = None,
) -> RunRights:
    return RunRights(
        grants=(WORKSPACE, REFERENCE),
        models=models,
        model_budget=ModelBudget(max_requests=3, max_tokens=100) if budget is None else budget,
        network=network,
        env=env,
        without_sandbox=without_sandbox,
    )


def reads(path: str = EVERY_PATH) -> FileCapability:
    return FileCapability(path=path, mode=PathMode.RO)


def writes(path: str = EVERY_PATH) -> FileCapability:
    return FileCapability(path=path, mode=PathMode.RW)


def read(path: str) -> PathAccess:
    return PathAccess(path=path, access="read")


def write(path: str) -> PathAccess:
    return PathAccess(path=path, access="write")


EVERYTHING: Final = Capabilities(
    files=(writes(),), network=(ANY,), model_access=(ANY,), env=(ANY,), exec=True
)
UNDECLARED: Final = "which its manifest does not declare"


@dataclass(frozen=True, kw_only=True)
class Row:
    """A call of ``t.tool`` requesting ``request`` under ``declared`` and ``rights``:
    allowed (``resolved``: the visible paths, in order) or refused with ``code`` and a
    message that is, or (``exact=False``) contains, ``says``."""

    id: str
    request: CapabilityRequest
    declared: Capabilities = EVERYTHING
    rights: RunRights = field(default_factory=rights)
    code: ErrorCode | None = None
    says: str = ""
    exact: bool = True
    resolved: tuple[str, ...] = ()


ROWS: Final = [
    # --- nothing requested ---------------------------------------------------------------
    Row(id="nothing", request=NO_REQUEST, declared=NO_CAPABILITIES),
    Row(id="nothing-in-a-fresh-request", request=CapabilityRequest(), declared=NO_CAPABILITIES),
    # --- files ---------------------------------------------------------------------------
    Row(
        id="files-read-allowed",
        request=CapabilityRequest(paths=(read("notes.md"),)),
        declared=Capabilities(files=(reads(),)),
        resolved=("/workspace/notes.md",),
    ),
    Row(
        id="files-read-and-write-resolved-in-order",
        request=CapabilityRequest(paths=(read("a.md"), write("/workspace/b.md"))),
        declared=Capabilities(files=(writes(),)),
        resolved=("/workspace/a.md", "/workspace/b.md"),
    ),
    Row(
        id="files-inside-a-narrow-declaration",
        request=CapabilityRequest(paths=(write("data/x.json"),)),
        declared=Capabilities(files=(writes("/workspace/data"),)),
        resolved=("/workspace/data/x.json",),
    ),
    Row(
        id="files-refused-outside-the-grants",
        request=CapabilityRequest(paths=(read("/etc/passwd"),)),
        code=ErrorCode.POLICY_DENIED,
        says="Cannot read '/etc/passwd': path is outside the readable paths.\n"
        "Readable paths: /workspace, /workspace/reference",
    ),
    Row(
        id="files-refused-read-only",
        request=CapabilityRequest(paths=(write("reference/x.md"),)),
        code=ErrorCode.POLICY_DENIED,
        says="Cannot write to 'reference/x.md': path is read-only.\n"
        "Writable paths: /workspace (except /workspace/reference)",
    ),
    Row(
        id="files-malformed-is-the-callers-whatever-is-declared",
        request=CapabilityRequest(paths=(read(""),)),
        declared=Capabilities(files=(reads("/workspace/data"),)),
        code=ErrorCode.INVALID_ARGS,
        says="path is empty; name a file or directory",
    ),
    Row(
        id="files-undeclared-write",
        request=CapabilityRequest(paths=(write("notes.md"),)),
        declared=Capabilities(files=(reads(),)),
        code=ErrorCode.INTERNAL,
        says="t.tool asked for write access to 'notes.md', which its manifest does not "
        "declare (files: / (ro)); a tool gets only what it declares, so the call is "
        "refused. This is a fault of the tool's definition, not of the call: tell the "
        "operator",
    ),
    Row(
        id="files-undeclared-path-even-one-the-run-may-read",
        request=CapabilityRequest(paths=(read("data/../secrets.md"),)),
        declared=Capabilities(files=(writes("/workspace/data"),)),
        code=ErrorCode.INTERNAL,
        says="read access to 'data/../secrets.md', which its manifest does not declare "
        "(files: /workspace/data (rw))",
        exact=False,
    ),
    Row(
        id="files-none-declared",
        request=CapabilityRequest(paths=(read("notes.md"),)),
        declared=NO_CAPABILITIES,
        code=ErrorCode.INTERNAL,
        says="(files: none)",
        exact=False,
    ),
    # --- network -------------------------------------------------------------------------
    Row(id="network-allowed", request=CapabilityRequest(domains=("example.org",))),
    Row(
        id="network-allowed-by-a-wildcard",
        request=CapabilityRequest(domains=("api.corp.example",)),
        declared=Capabilities(network=("*.corp.example",)),
    ),
    Row(
        id="network-refused-host",
        request=CapabilityRequest(domains=("evil.example",)),
        code=ErrorCode.POLICY_DENIED,
        says="host 'evil.example' is not allowed; allowed domains: example.org, "
        "*.corp.example (network.allow_domains; '*.x' means subdomains of x)",
    ),
    Row(
        id="network-refused-none-allowed",
        request=CapabilityRequest(domains=("example.org",)),
        rights=rights(network=NetworkSection()),
        code=ErrorCode.POLICY_DENIED,
        says="this run may reach no host: the policy's network.allow_domains is empty",
    ),
    Row(
        id="network-undeclared",
        request=CapabilityRequest(domains=("example.org",)),
        declared=Capabilities(network=("*.corp.example",)),
        code=ErrorCode.INTERNAL,
        says="asked for the network host 'example.org', which its manifest does not "
        "declare (network: *.corp.example)",
        exact=False,
    ),
    # --- model access and the model budget ----------------------------------------------
    Row(id="model-allowed", request=CapabilityRequest(models=("assistant",))),
    Row(
        id="model-refused",
        request=CapabilityRequest(models=("other",)),
        code=ErrorCode.POLICY_DENIED,
        says="model 'other' is not granted to this run; models it may use: assistant",
    ),
    Row(
        id="model-refused-none-granted",
        request=CapabilityRequest(models=("assistant",)),
        rights=rights(models=()),
        code=ErrorCode.POLICY_DENIED,
        says="model 'assistant' is not granted to this run; models it may use: none "
        "(the policy's model_access is empty)",
    ),
    Row(
        id="model-budget-requests-spent",
        request=CapabilityRequest(models=("assistant",)),
        rights=rights(budget=ModelBudget(max_requests=3, max_tokens=100, requests=3)),
        code=ErrorCode.RATE_LIMITED,
        says="this run's 3 model requests are spent (model_access.max_requests / max_tokens)",
    ),
    Row(
        id="model-budget-tokens-spent",
        request=CapabilityRequest(models=("assistant",)),
        rights=rights(budget=ModelBudget(max_requests=3, max_tokens=100, tokens=100)),
        code=ErrorCode.RATE_LIMITED,
        says="this run's 100 model tokens are spent (model_access.max_requests / max_tokens)",
    ),
    Row(
        id="model-undeclared",
        request=CapabilityRequest(models=("assistant",)),
        declared=Capabilities(model_access=("reviewer",)),
        code=ErrorCode.INTERNAL,
        says="asked for model 'assistant', which its manifest does not declare "
        "(model_access: reviewer)",
        exact=False,
    ),
    # --- environment names ---------------------------------------------------------------
    Row(id="env-allowed", request=CapabilityRequest(env=("LANG",))),
    Row(
        id="env-refused",
        request=CapabilityRequest(env=("AWS_SECRET_ACCESS_KEY",)),
        code=ErrorCode.POLICY_DENIED,
        says="environment variable 'AWS_SECRET_ACCESS_KEY' is not allowed for this run; "
        "allowed: LANG (env.allow)",
    ),
    Row(
        id="env-refused-none-allowed",
        request=CapabilityRequest(env=("LANG",)),
        rights=rights(env=()),
        code=ErrorCode.POLICY_DENIED,
        says="environment variable 'LANG' is not allowed for this run; allowed: none (env.allow)",
    ),
    Row(
        id="env-undeclared",
        request=CapabilityRequest(env=("LANG",)),
        declared=Capabilities(env=("TZ",)),
        code=ErrorCode.INTERNAL,
        says="asked for environment variable 'LANG', which its manifest does not declare (env: TZ)",
        exact=False,
    ),
    # --- exec ----------------------------------------------------------------------------
    Row(id="exec-allowed", request=CapabilityRequest(exec=True)),
    Row(
        id="exec-refused-without-an-os-sandbox",
        request=CapabilityRequest(exec=True),
        rights=rights(without_sandbox="no bwrap"),
        code=ErrorCode.POLICY_DENIED,
        says="t.tool runs commands only inside an OS sandbox, and this run has none "
        "(no bwrap); the file tools still work",
    ),
    Row(
        id="exec-undeclared",
        request=CapabilityRequest(exec=True),
        declared=Capabilities(files=(writes(),)),
        code=ErrorCode.INTERNAL,
        says="asked for running a command, which its manifest does not declare (exec: no)",
        exact=False,
    ),
    # --- the first refusal wins ---------------------------------------------------------
    Row(
        id="undeclared-before-the-runs-rights",
        request=CapabilityRequest(domains=("evil.example",), exec=True),
        declared=Capabilities(network=(ANY,)),
        code=ErrorCode.INTERNAL,
        says="running a command",
        exact=False,
    ),
    Row(
        id="paths-before-the-network",
        request=CapabilityRequest(paths=(read("/etc/x"),), domains=("evil.example",)),
        code=ErrorCode.POLICY_DENIED,
        says="Cannot read '/etc/x'",
        exact=False,
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_a_call_gets_what_its_tool_declares_and_its_run_grants(row: Row) -> None:
    decision = check_call("t.tool", row.declared, row.request, row.rights)
    if row.code is None:
        assert isinstance(decision, Allow), decision
        assert tuple(r.visible for r in decision.resolved) == row.resolved
    else:
        assert isinstance(decision, Deny), decision
        assert decision.code is row.code
        if row.exact:
            assert decision.message == row.says
        else:
            assert row.says in decision.message


def test_a_call_that_requests_nothing_is_allowed_without_a_look_at_the_run() -> None:
    assert check_call("time.now", NO_CAPABILITIES, NO_REQUEST, rights()) is EVERYTHING_ALLOWED


def test_a_spent_budget_is_refused_only_for_a_call_that_asks_a_model() -> None:
    spent = rights(budget=ModelBudget(max_requests=1, max_tokens=1, requests=1))
    assert isinstance(check_call("t", EVERYTHING, CapabilityRequest(exec=True), spent), Allow)
    refused = check_call("t", EVERYTHING, CapabilityRequest(models=("assistant",)), spent)
    assert isinstance(refused, Deny) and refused.code is ErrorCode.RATE_LIMITED


@pytest.mark.parametrize(
    "path", ["workspace", "/workspace/", "/workspace/../etc", "/workspace/./x", "//workspace", ""]
)
def test_a_file_capability_names_an_absolute_normalized_path(path: str) -> None:
    with pytest.raises(ValueError, match="absolute and normalized"):
        FileCapability(path=path, mode=PathMode.RO)


def test_a_declaration_names_something_in_every_entry() -> None:
    with pytest.raises(ValueError, match="names nothing"):
        Capabilities(network=("",))


def test_a_declaration_reads_and_writes_as_the_manifest_shows_it() -> None:
    declared = Capabilities(
        files=(writes("/workspace/data"),), network=("example.org",), model_access=(ANY,)
    )
    shown = msgspec.json.decode(msgspec.json.encode(declared))
    assert shown == {
        "files": [{"path": "/workspace/data", "mode": "rw"}],
        "network": ["example.org"],
        "modelAccess": ["*"],
        "env": [],
        "exec": False,
    }
    assert msgspec.convert(shown, Capabilities) == declared
