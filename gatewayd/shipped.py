"""Where the files gatewayd ships beside its code lie: the policies and the systemd units.

They are package data under ``gatewayd/data/`` (pyproject.toml's
``[tool.setuptools.package-data]``), found through :mod:`importlib.resources`, so the
same lookup works from a checkout and from an installed wheel. In a checkout
``gatewayd/data/policies`` and ``gatewayd/data/systemd`` are symbolic links to the
top-level ``policies/`` and ``systemd/`` (the files the docs and the tests name); a wheel
holds copies of them.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Final

_DATA_PACKAGE: Final = "gatewayd"
_DATA_DIR: Final = "data"


class ShippedDataMissing(RuntimeError):
    """This installation of gatewayd lacks a file it ships (a broken wheel or checkout)."""


def shipped_path(*parts: str) -> Path:
    """The real path of a shipped file or directory, e.g. ``shipped_path("policies")``.

    The path is resolved (the checkout's links followed), so it names the same file the
    docs and the tests name. Error handling: ShippedDataMissing when gatewayd is imported
    from something that is no directory tree (a zip file): gatewayd reads these files by
    path (policy directories, the unit a copy is made of) and could not use them there.
    """
    found = files(_DATA_PACKAGE).joinpath(_DATA_DIR, *parts)
    if not isinstance(found, Path):
        raise ShippedDataMissing(
            f"gatewayd is imported from {files(_DATA_PACKAGE)!s}, not a directory: install "
            "it as a wheel into a virtualenv (make install, docs/operations.md)"
        )
    return found.resolve()
