"""Every module of gatewayd sits in a layer of import-linter's layers contract
(pyproject.toml), so `make lint` judges it: a new module has to find its layer."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Packages whose modules sit in different layers, so each of their children is listed.
SPLIT_PACKAGES = (
    "gatewayd.runs",
    "gatewayd.apps",
    "gatewayd.mcp",
    "gatewayd.runners",
    "gatewayd.scaleout",
)


def _layers() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return {name for layer in contract["layers"] for name in re.split(r"[|:\s]+", layer) if name}


def _children(package: str) -> set[str]:
    folder = ROOT.joinpath(*package.split("."))
    return {
        f"{package}.{path.stem if path.is_file() else path.name}"
        for path in folder.iterdir()
        if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").exists()
    }


def test_every_module_of_gatewayd_sits_in_a_layer() -> None:
    """A new module finds its layer: the layers contract only judges what it lists."""
    expected = _children("gatewayd") - set(SPLIT_PACKAGES)
    for package in SPLIT_PACKAGES:
        expected |= _children(package)
    assert expected - _layers() == set(), "add these to the layers in pyproject.toml"
    assert _layers() - expected == set(), "these layers name no module of gatewayd"
