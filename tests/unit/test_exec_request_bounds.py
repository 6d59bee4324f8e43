"""The control socket's exec request (``POST /v1/runs/{id}/exec``) bounds every option
before anything reads it: the options are written to the audit log (``exec_started``)
before they are checked against the run, so an unbounded one would be an unbounded
audit entry."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest

from gatewayd.control import ExecRequest
from gatewayd.policy.package_managers import package_manager_names
from gatewayd.policy.paths import MAX_PATH_BYTES


def parse(**options: Any) -> ExecRequest:
    return ExecRequest.model_validate_json(json.dumps({"command": ["true"], **options}))


@pytest.mark.parametrize(
    "options",
    [
        {"cwd": "/workspace/" + "a" * MAX_PATH_BYTES},
        {"allowedDomains": ["a" * 300 + ".org"]},
        {"packageManagers": ["pypi"] * (len(package_manager_names()) + 1)},
        {"packageManagers": ["p" * 1000]},
        {"env": {"N" * 1000: "v"}},
    ],
    ids=["cwd", "domain", "managers", "manager-name", "env-name"],
)
def test_an_oversized_option_is_refused_before_it_is_read(options: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        parse(**options)


def test_options_within_bounds_are_taken() -> None:
    request = parse(
        cwd="/workspace/src",
        allowedDomains=["pypi.org"],
        packageManagers=list(package_manager_names()),
        env={"LANG": "C"},
    )
    options = request.options()
    assert options is not None and options.cwd == "/workspace/src"
