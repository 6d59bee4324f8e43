"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gatewayd.hostpaths.beneath import Resolver, forced_resolver, openat2_available


@pytest.fixture(params=[Resolver.OPENAT2, Resolver.WALK], ids=["openat2", "walk"])
def resolver(request: pytest.FixtureRequest) -> Iterator[Resolver]:
    """Run the test once per path resolver: openat2 (where the kernel allows it) and the
    no-symlink walk fallback, so both face the same escape corpus."""
    wanted: Resolver = request.param
    if wanted is Resolver.OPENAT2 and not openat2_available():
        pytest.skip("this kernel does not allow openat2")
    with forced_resolver(wanted):
        yield wanted
