"""Reading a policy file: the file edge of :mod:`gatewayd.policy`, which parses text only.

A policy file is something someone else wrote, so it is read as any such input
(:mod:`gatewayd.inputfile`): a regular file (a FIFO or a device is refused without
blocking), at most :data:`MAX_POLICY_BYTES`, UTF-8. Every failure is a
:class:`~gatewayd.policy.PolicyError` naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from gatewayd.inputfile import InputFileError, read_input_file
from gatewayd.policy.model import Policy, PolicyError, parse_policy_text, validate_policy

# A policy is a few hundred lines at most; refusing anything bigger stops a wrong
# path (a log, a binary) from being parsed and echoed back in error messages.
MAX_POLICY_BYTES: Final = 1 << 20


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
