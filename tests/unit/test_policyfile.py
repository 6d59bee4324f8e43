"""Reading a policy file: a real file parsed and validated, every failure a PolicyError
that names the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from gatewayd.policy import PolicyError
from gatewayd.policyfile import MAX_POLICY_BYTES, load_policy
from tests.unit.test_policy_model import FULL

# --- load_policy: the file edge -------------------------------------------------------


def test_load_policy_reads_a_real_file_and_names_it_in_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(FULL)
    assert load_policy(good).name == "full"
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nname: p\ntools: {allow: [Bad]}\n")
    with pytest.raises(PolicyError) as info:
        load_policy(bad)
    assert info.value.source == str(bad)
    assert str(info.value).startswith(f"{bad}: tools.allow.0: 'Bad' is neither")


def test_missing_file_is_a_policy_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path / "nope.yaml")
    assert (
        str(info.value)
        == f"{tmp_path / 'nope.yaml'}: cannot read the policy file: No such file or directory"
    )


def test_directory_instead_of_file_is_a_policy_error(tmp_path: Path) -> None:
    with pytest.raises(
        PolicyError, match="the policy file must be a regular file, not a directory"
    ):
        load_policy(tmp_path)


def test_oversized_file_is_refused_before_parsing(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_bytes(b"version: 1\nname: p\n" + b"#" * MAX_POLICY_BYTES)
    with pytest.raises(PolicyError, match=f"larger than {MAX_POLICY_BYTES} bytes"):
        load_policy(big)


def test_non_utf8_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"version: 1\nname: caf\xe9\n")
    with pytest.raises(PolicyError, match=r"not UTF-8 text \(bad byte at offset 20\)"):
        load_policy(path)
