"""How many examples each Hypothesis property tries: the count its test names, or fewer
in the fast lane.

`make test` and CI run every property at the count its test names. `make test-fast`, the
edit-test loop, sets COGNI_TEST_EXAMPLES_SCALE (a factor in (0, 1]) and runs the same
properties on that share of their examples. An explicit ``@settings(max_examples=N)``
overrides any Hypothesis profile, so the tests name their counts through ``examples(N)``
(tests/unit/test_hypothesis_counts.py keeps every count in tests/ going through it), and
``load_profile`` scales the default count of the properties that name none.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from hypothesis import settings

SCALE_VARIABLE = "COGNI_TEST_EXAMPLES_SCALE"
# A scaled property still tries this many examples (or all of its own, if it names fewer):
# fewer would hardly leave the explicit and boundary examples Hypothesis tries first.
MIN_EXAMPLES = 10
PROFILE = "cogni-scaled"


def scale_from(environ: Mapping[str, str]) -> float:
    """The factor the environment sets; 1 (the full count) when it sets none."""
    text = environ.get(SCALE_VARIABLE, "").strip()
    if not text:
        return 1.0
    try:
        scale = float(text)
    except ValueError:
        raise ValueError(f"{SCALE_VARIABLE}={text!r} is not a number") from None
    if not 0 < scale <= 1:  # also refuses nan: a typo must not run zero examples
        raise ValueError(f"{SCALE_VARIABLE}={text!r} is not a factor in (0, 1]")
    return scale


def scaled(count: int, scale: float) -> int:
    """``count`` examples scaled by ``scale``, never under MIN_EXAMPLES unless ``count`` is."""
    if scale == 1:
        return count
    return max(min(count, MIN_EXAMPLES), math.ceil(count * scale))


SCALE = scale_from(os.environ)


def examples(count: int) -> int:
    """The ``max_examples`` of a property whose full strength is ``count`` examples."""
    return scaled(count, SCALE)


def scaled_profile(base: settings, scale: float) -> settings:
    """``base`` with its default count scaled by ``scale``."""
    return settings(base, max_examples=scaled(base.max_examples, scale))


def load_profile() -> None:
    """Scale the default count of the properties that name none (tests/conftest.py calls
    this before any test module is imported: settings made later inherit from it)."""
    if SCALE == 1:
        return
    settings.register_profile(PROFILE, scaled_profile(settings(), SCALE))
    settings.load_profile(PROFILE)
