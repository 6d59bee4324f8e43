"""Reading a policy file: the file edge of :mod:`gatewayd.policy`, which parses text only.

A policy file is something someone else wrote, so it is read as any such input
(:mod:`gatewayd.inputfile`): a regular file (a FIFO or a device is refused without
blocking), at most :data:`MAX_POLICY_BYTES`, UTF-8. Every failure is a
:class:`~gatewayd.policy.PolicyError` naming the file.

:class:`PolicyLoader` finds the file a run's ``policy`` names: by name in the configured
policy directories, or (gatewayd's own command line, a live run's source) by path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Final

from gatewayd.inputfile import InputFileError, read_input_file
from gatewayd.policy.model import (
    POLICY_NAME_RE,
    Policy,
    PolicyError,
    parse_policy_text,
    validate_policy,
)

# A policy is a few hundred lines at most; refusing anything bigger stops a wrong
# path (a log, a binary) from being parsed and echoed back in error messages.
MAX_POLICY_BYTES: Final = 1 << 20
# A policy named by its name is the file ``<name>.yaml`` in a policy directory
# (policy.model's POLICY_NAME_RE: the characters of a policy's own ``name`` field).
POLICY_SUFFIX: Final = ".yaml"
# A name longer than this is shown cut in a refusal (it is no policy's name anyway).
MAX_SHOWN_NAME_CHARS: Final = 70


def load_policy(path: Path) -> Policy:
    """Read and validate the policy file at ``path``.

    Error handling: every failure (unreadable, not a regular file, too large, not
    UTF-8, bad YAML, invalid fields) is a :class:`PolicyError` whose source is
    ``str(path)``.
    """
    return validate_policy(read_policy_mapping(path), str(path))


def read_policy_mapping(path: Path) -> dict[str, Any]:
    """The policy file at ``path`` parsed, not yet validated: a regular file, size-capped,
    UTF-8, strict YAML (see :mod:`gatewayd.strictyaml`), a mapping at the top. For tools
    that edit a policy.

    Error handling: :class:`PolicyError` whose source is ``str(path)``.
    """
    source = str(path)
    try:
        data = read_input_file(path, max_bytes=MAX_POLICY_BYTES, what="the policy file")
    except InputFileError as exc:
        raise PolicyError(source, [str(exc)]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(
            source, [f"policy file is not UTF-8 text (bad byte at offset {exc.start})"]
        ) from None
    return parse_policy_text(text, source)


class PolicyLoader:
    """Turns a request's ``policy`` string into a loaded policy: (policy, source path).

    :meth:`by_name` looks a name up as ``<name>.yaml`` in the configured policy
    directories, in order, and nothing else: what a control-socket caller may ask for.
    Calling the loader also takes a path (anything with a ``/`` or a ``.yaml``/``.yml``
    suffix), for gatewayd's own command line and a live run's recorded source.
    """

    def __init__(self, search_dirs: tuple[Path, ...]) -> None:
        self.search_dirs = search_dirs

    def by_name(self, name: str) -> tuple[Policy, str]:
        """The policy called ``name`` in the policy directories.

        Error handling: PolicyError for a string that is not a policy name (a path, a
        long string: nothing is looked up) or a name no directory holds.
        """
        if not POLICY_NAME_RE.fullmatch(name):
            shown = (
                repr(name)
                if len(name) <= MAX_SHOWN_NAME_CHARS
                else repr(name[:64]) + f"... ({len(name)} characters)"
            )
            raise PolicyError(
                "policy",
                [
                    f"{shown} is not a policy name: give the name of a policy in the "
                    f"policy directories ({self._where()}), 1-64 letters, digits and ._- "
                    "(e.g. 'demo'); a path is not accepted here"
                ],
            )
        for directory in self.search_dirs:
            path = directory / f"{name}{POLICY_SUFFIX}"
            if os.path.lexists(path):
                # The source is the file itself: what the audit names and a reload reads.
                return load_policy(path), os.path.realpath(path)
        hint = ""
        if name.endswith((".yaml", ".yml")):
            stem = name.rsplit(".", 1)[0]
            hint = f" (a policy's name is its file's name without the suffix: {stem!r})"
        raise PolicyError(name, [f"no policy named {name!r} in {self._where()}{hint}"])

    def __call__(self, ref: str) -> tuple[Policy, str]:
        if "/" in ref or ref.endswith((".yaml", ".yml")):
            path = Path(ref)
            return load_policy(path), str(path)
        return self.by_name(ref)

    def _where(self) -> str:
        return ", ".join(str(d) for d in self.search_dirs) or "(no policy directory configured)"
