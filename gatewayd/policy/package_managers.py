"""Package managers as named sets of registry domains: what a policy's
``network.package_managers`` lists, and what an exec's ``packageManagers`` asks for.

A command that installs packages needs its registry's hosts, and an operator should not
have to know that ``pip`` downloads from ``files.pythonhosted.org`` while its index is
``pypi.org``. Each set here is a fixed list of the hosts the tool's *default* registry
uses (no mirrors, no wildcards: a wildcard such as ``*.npmjs.org`` would let a command
reach every host a registry's owner ever names). A policy that lists a set adds its
domains to the run's allowlist (:attr:`~gatewayd.policy.model.NetworkSection.
reachable_domains`), so the run's egress proxy and ``http.fetch`` reach them; an exec
that names a set narrows that command's network to its domains.

Pure: names and domains only. A change to a set changes what every policy listing it
allows, so each entry says where its hosts come from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Final

# The default registries' hosts, as each client reaches them over HTTPS.
PACKAGE_MANAGERS: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        # pip, uv, poetry: the index (pypi.org/simple) and the files it links to.
        "pypi": ("pypi.org", "files.pythonhosted.org"),
        # npm, pnpm, yarn (its default registry is a CNAME of npm's since yarn 2).
        "npm": ("registry.npmjs.org", "registry.yarnpkg.com"),
        # cargo: the sparse index and the crate downloads (crates.io redirects there).
        "crates": ("crates.io", "index.crates.io", "static.crates.io"),
        # go: the module proxy and the checksum database (GOPROXY, GOSUMDB defaults).
        "go": ("proxy.golang.org", "sum.golang.org"),
        # gem, bundler: the API and its index.
        "rubygems": ("rubygems.org", "index.rubygems.org"),
        # maven, gradle: Maven Central under both of its names.
        "maven": ("repo.maven.apache.org", "repo1.maven.org"),
    }
)


def package_manager_names() -> tuple[str, ...]:
    """Every known set's name, in a stable order (for messages and the schema)."""
    return tuple(PACKAGE_MANAGERS)


def unknown_package_manager(name: str) -> str | None:
    """Why ``name`` is not a package manager (listing the known ones), or None."""
    if name in PACKAGE_MANAGERS:
        return None
    return f"unknown package manager {name!r}; known: {', '.join(package_manager_names())}"


def package_manager_domains(names: Iterable[str]) -> tuple[str, ...]:
    """The domains of the sets ``names`` (each known), in order, each once.

    Error handling: ValueError naming an unknown set."""
    domains: list[str] = []
    for name in names:
        refusal = unknown_package_manager(name)
        if refusal is not None:
            raise ValueError(refusal)
        domains += [d for d in PACKAGE_MANAGERS[name] if d not in domains]
    return tuple(domains)
