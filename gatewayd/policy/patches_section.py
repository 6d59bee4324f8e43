"""The policy's ``patches`` section: what an agent run's patch leaves out besides the
repository's own ignore rules.

```yaml
patches:
  exclude: ["__pycache__", "*.pyc", ".pytest_cache", "node_modules", "dist"]
```

``exclude`` replaces the default list (:data:`DEFAULT_PATCH_EXCLUDE`: caches that
running a repository's tests, linters and package managers leaves behind). Each entry
is one file or directory name, or a shell glob of one (``*``, ``?``, ``[...]``), matched
case-sensitively against every component of a changed path: a directory's name leaves
out everything beneath it. No ``/``: an entry names what a command makes anywhere in the
tree, not one place. A file the repository tracks is always kept, whatever matches it
(gatewayd/agent/patches.py applies the list).
"""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import AfterValidator, Field, StrictStr

from gatewayd.policy.section import Section

# What running a repository's own commands commonly leaves in the tree: bytecode, test,
# type-checker and linter caches, virtual environments, installed packages, coverage
# data, packaging metadata, a desktop's folder settings. Never a name a project uses
# for its sources (``build``, ``dist``, ``out`` may be either: a repository's
# .gitignore says which).
DEFAULT_PATCH_EXCLUDE: Final = (
    "__pycache__",
    "*.pyc",
    "*.pyo",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".hypothesis",
    ".tox",
    ".nox",
    ".venv",
    "node_modules",
    ".coverage",
    "*.egg-info",
    ".DS_Store",
)
# A file name's length limit on Linux: a longer entry can match no component.
MAX_EXCLUDE_PATTERN_CHARS: Final = 255
# Each changed path is matched against every entry: the list stays a list of names.
MAX_EXCLUDE_PATTERNS: Final = 256


def _check_pattern(value: str) -> str:
    if not value or len(value) > MAX_EXCLUDE_PATTERN_CHARS:
        raise ValueError(
            f"an exclude entry must be 1 to {MAX_EXCLUDE_PATTERN_CHARS} characters "
            "(a file or directory name, or a glob of one)"
        )
    if "/" in value or "\x00" in value or value in (".", ".."):
        raise ValueError(
            f"exclude entry {value!r} must be one name or a glob of one (no '/', not '.' "
            "or '..'): it is matched against every component of a changed path"
        )
    return value


ExcludePattern = Annotated[StrictStr, AfterValidator(_check_pattern)]


class PatchesSection(Section):
    """What a patch made from an agent run's workspace leaves out (see the module doc)."""

    exclude: Annotated[tuple[ExcludePattern, ...], Field(max_length=MAX_EXCLUDE_PATTERNS)] = (
        DEFAULT_PATCH_EXCLUDE
    )
