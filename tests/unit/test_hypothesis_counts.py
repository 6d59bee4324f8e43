"""The fast lane's Hypothesis counts: the full count unless the environment scales it, and
every count in tests/ named through the helper (an explicit count would ignore the scale)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import settings

from tests.conftest import ROOT
from tests.hypothesis_counts import (
    MIN_EXAMPLES,
    SCALE_VARIABLE,
    examples,
    scale_from,
    scaled,
    scaled_profile,
)


def test_no_variable_means_the_full_count() -> None:
    assert scale_from({}) == 1
    assert scale_from({SCALE_VARIABLE: ""}) == 1
    assert scaled(300, 1) == 300
    assert scaled(3, 1) == 3


def test_a_factor_scales_each_count_rounding_up_but_not_under_the_floor() -> None:
    assert scale_from({SCALE_VARIABLE: "0.25"}) == 0.25
    assert scaled(300, 0.1) == 30
    assert scaled(301, 0.1) == 31
    assert scaled(40, 0.1) == MIN_EXAMPLES
    assert scaled(1000, 0.001) == MIN_EXAMPLES
    assert scaled(5, 0.1) == 5  # a count under the floor is kept whole


@pytest.mark.parametrize("text", ["0", "-0.5", "1.5", "nan", "inf", "a tenth", "1/10"])
def test_a_value_that_is_not_a_factor_in_zero_to_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=SCALE_VARIABLE):
        scale_from({SCALE_VARIABLE: text})


def test_the_profile_scales_the_default_count_and_keeps_the_rest() -> None:
    base = settings(max_examples=100, deadline=None)
    profile = scaled_profile(base, 0.2)
    assert profile.max_examples == 20
    assert profile.deadline is None
    assert scaled_profile(base, 1).max_examples == 100


def test_the_properties_that_name_no_count_get_the_scaled_default() -> None:
    # In this process: the full 100 under `make test`, the scaled count under test-fast.
    assert settings().max_examples == examples(settings.get_profile("default").max_examples)


def test_every_count_in_the_tests_goes_through_the_helper() -> None:
    bare = []
    # The helper and this file name counts in their prose and patterns.
    own = {ROOT / "tests" / "hypothesis_counts.py", Path(__file__).resolve()}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path in own or "node_modules" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"max_examples\s*=\s*(?!examples\()", line):
                bare.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert bare == []
