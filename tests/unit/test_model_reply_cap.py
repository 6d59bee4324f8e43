"""The reply cap's pure parts: the alias setting and its bounds, the bounded inflater, and
words for the agent for every kind of model failure (the sockets are in
tests/integration/test_model_reply_cap.py)."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from gatewayd.config import DEFAULT_MAX_REPLY_BYTES, MAX_REPLY_BYTES, MIN_REPLY_BYTES, ConfigError
from gatewayd.configsources import load_config
from gatewayd.model_client import ModelCallKind
from gatewayd.model_transport import INFLATE_PIECE_BYTES, _Inflater
from gatewayd.review.reviewer import _FAILURE_WORDS

ALIAS = "models: {{r: {{provider: openai, model: m{extra}}}}}"


def config_with(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "gatewayd.yaml"
    path.write_text(ALIAS.format(extra=extra))
    return path


def test_an_alias_has_the_default_cap_unless_it_sets_its_own(tmp_path: Path) -> None:
    assert load_config(config_with(tmp_path, "")).models["r"].max_reply_bytes == (
        DEFAULT_MAX_REPLY_BYTES
    )
    own = load_config(config_with(tmp_path, f", max_reply_bytes: {MAX_REPLY_BYTES}"))
    assert own.models["r"].max_reply_bytes == MAX_REPLY_BYTES


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (MIN_REPLY_BYTES - 1, f"greater than or equal to {MIN_REPLY_BYTES}"),
        (MAX_REPLY_BYTES + 1, f"less than or equal to {MAX_REPLY_BYTES}"),
        ("'8 MiB'", "Input should be a valid integer"),
    ],
)
def test_a_cap_out_of_bounds_is_refused_naming_the_field_and_the_bound(
    tmp_path: Path, value: object, says: str
) -> None:
    path = config_with(tmp_path, f", max_reply_bytes: {value}")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert "models.r.max_reply_bytes" in str(caught.value) and says in str(caught.value)


def test_a_gzip_bomb_inflates_a_bounded_piece_at_a_time() -> None:
    """64 MiB of zeros is about 64 KiB of gzip: fed in one go, it still comes out in
    pieces no larger than INFLATE_PIECE_BYTES, each counted before the next is made."""
    size = 64 << 20
    packer = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    bomb = b"".join(packer.compress(bytes(1 << 20)) for _ in range(size >> 20)) + packer.flush()
    assert len(bomb) < size // 500
    pieces = [len(piece) for piece in _Inflater().feed(bomb)]
    assert max(pieces) <= INFLATE_PIECE_BYTES
    assert sum(pieces) == size


def test_the_agent_is_told_something_for_every_kind_of_model_failure() -> None:
    """A review that fails with a kind the reviewer has no words for would read "the
    reviewer failed; try again later", which is wrong for a kind a retry cannot fix."""
    assert set(_FAILURE_WORDS) == {str(kind) for kind in ModelCallKind}
    assert _FAILURE_WORDS["too_large"] == ("the reviewer's reply was too large", False)
