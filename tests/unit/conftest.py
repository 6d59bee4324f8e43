"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported where used: xdist's controller loads this file and runs no test
    from gatewayd.hostpaths.beneath import Resolver


@pytest.fixture(params=["openat2", "walk"])
def resolver(request: pytest.FixtureRequest) -> Iterator[Resolver]:
    """Run the test once per path resolver: openat2 (where the kernel allows it) and the
    no-symlink walk fallback, so both face the same escape corpus."""
    from gatewayd.hostpaths.beneath import Resolver, forced_resolver, openat2_available

    wanted = Resolver(request.param)
    if wanted is Resolver.OPENAT2 and not openat2_available():
        pytest.skip("this kernel does not allow openat2")
    with forced_resolver(wanted):
        yield wanted
