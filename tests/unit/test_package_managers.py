"""Package managers as named domain sets, the policy field that lists them, and one
command's network narrowed from its run's (never widened): pure, table-driven."""

from __future__ import annotations

import pytest

from gatewayd.errors import InvalidArguments, PolicyViolation
from gatewayd.policy import PolicyError
from gatewayd.policy.model import NetworkSection, load_policy_text
from gatewayd.policy.network import check_any_host_allowed, check_host, narrowed_network
from gatewayd.policy.package_managers import (
    PACKAGE_MANAGERS,
    package_manager_domains,
    unknown_package_manager,
)
from gatewayd.protocol import ErrorCode

NET = NetworkSection(
    allow_domains=("example.org", "*.github.com"),
    package_managers=("pypi",),
    proxy={"enabled": True},  # type: ignore[arg-type]
)


def test_every_set_is_exact_hosts_never_a_wildcard() -> None:
    for name, domains in PACKAGE_MANAGERS.items():
        assert domains, name
        for domain in domains:
            assert "*" not in domain and domain == domain.lower(), (name, domain)


def test_domains_of_sets_are_in_order_each_once_and_an_unknown_set_is_named() -> None:
    assert package_manager_domains(["pypi", "pypi"]) == ("pypi.org", "files.pythonhosted.org")
    with pytest.raises(ValueError, match="unknown package manager 'pip'; known: pypi, npm"):
        package_manager_domains(["pip"])
    assert unknown_package_manager("npm") is None


def test_a_policy_listing_a_set_reaches_its_domains_and_gets_a_proxy() -> None:
    assert NET.reachable_domains == (
        "example.org",
        "*.github.com",
        "pypi.org",
        "files.pythonhosted.org",
    )
    only_sets = NetworkSection(package_managers=("npm",), proxy={"enabled": True})  # type: ignore[arg-type]
    assert only_sets.proxy_enabled
    check_any_host_allowed(only_sets)
    check_host("registry.npmjs.org", only_sets)
    with pytest.raises(PolicyViolation, match=r"network.allow_domains, package managers: npm"):
        check_host("example.org", only_sets)


def test_an_unknown_set_in_a_policy_is_an_error_naming_the_known_ones() -> None:
    text = "version: 1\nname: p\nnetwork:\n  package_managers: [pip]\n"
    with pytest.raises(PolicyError, match=r"network\.package_managers.*unknown package manager"):
        load_policy_text(text, "p.yaml")


@pytest.mark.parametrize(
    ("domains", "managers", "expected"),
    [
        (None, None, None),  # neither asked: the run's network
        ([], None, ()),  # no network at all
        (["example.org"], None, ("example.org",)),
        (["api.github.com", "*.x.github.com"], None, ("api.github.com", "*.x.github.com")),
        (["*.github.com"], ["pypi"], ("*.github.com", "pypi.org", "files.pythonhosted.org")),
        (["pypi.org"], ["pypi"], ("pypi.org", "files.pythonhosted.org")),
    ],
)
def test_a_command_may_narrow_to_what_its_run_reaches(
    domains: list[str] | None, managers: list[str] | None, expected: tuple[str, ...] | None
) -> None:
    narrowed = narrowed_network(NET, domains=domains, managers=managers)
    if expected is None:
        assert narrowed is None
        return
    assert narrowed is not None
    assert narrowed.allow_domains == expected
    # The sets' domains are in the list: the copy names no set, or they would join again.
    assert narrowed.package_managers == () and narrowed.reachable_domains == expected
    assert narrowed.ports == NET.ports and narrowed.proxy == NET.proxy


@pytest.mark.parametrize(
    ("domains", "managers", "code", "phrase"),
    [
        (["evil.org"], None, ErrorCode.POLICY_DENIED, "'evil.org' is not among the domains"),
        # wider than an entry: the wildcard, the parent, a wildcard above it
        (["github.com"], None, ErrorCode.POLICY_DENIED, "'github.com'"),
        (["*.com"], None, ErrorCode.POLICY_DENIED, "'*.com'"),
        (["*.example.org"], None, ErrorCode.POLICY_DENIED, "may only narrow"),
        (["sub.example.org"], None, ErrorCode.POLICY_DENIED, "example.org, *.github.com"),
        (None, ["npm"], ErrorCode.POLICY_DENIED, "'npm' is not allowed for this run"),
        (None, ["pip"], ErrorCode.INVALID_ARGS, "unknown package manager 'pip'"),
        (["Example.ORG"], None, ErrorCode.INVALID_ARGS, "is not a domain"),
        (["http://example.org"], None, ErrorCode.INVALID_ARGS, "is not a domain"),
        (["example.org:443"], None, ErrorCode.INVALID_ARGS, "is not a domain"),
        (["a.org"] * 65, None, ErrorCode.INVALID_ARGS, "at most 64"),
    ],
)
def test_widening_is_refused_naming_what(
    domains: list[str] | None, managers: list[str] | None, code: ErrorCode, phrase: str
) -> None:
    with pytest.raises((PolicyViolation, InvalidArguments)) as caught:
        narrowed_network(NET, domains=domains, managers=managers)
    assert caught.value.code is code
    assert phrase in str(caught.value)


def test_a_run_without_its_proxy_may_narrow_to_nothing_only() -> None:
    off = NET.model_copy(update={"proxy": NET.proxy.model_copy(update={"enabled": False})})
    assert narrowed_network(off, domains=[], managers=None) is not None
    for domains, managers in ((["example.org"], None), (None, ["pypi"])):
        with pytest.raises(PolicyViolation, match=r"network\.proxy\.enabled is false"):
            narrowed_network(off, domains=domains, managers=managers)
