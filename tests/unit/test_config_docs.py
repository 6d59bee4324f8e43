"""docs/configuration.md documents every setting of gatewayd's configuration: a row in the
"Settings" table naming the setting and its environment variable, and a row for every
field of a nested setting (``sandbox_uids``, ``models.<name>``) in the section whose
heading names it. Same rules as the policy reference (tests/unit/test_policy_docs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from gatewayd.config import GatewaydConfig
from gatewayd.configsources import env_name
from tests.unit.test_policy_docs import documented_rows, field_paths

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
SETTINGS_HEADING = "Settings"


def _settings_rows(text: str) -> dict[str, str]:
    """Setting name -> its whole row in the "Settings" section."""
    rows: dict[str, str] = {}
    inside = False
    for line in text.splitlines():
        if line.startswith("#"):
            inside = line.lstrip("#").strip() == SETTINGS_HEADING
        elif inside and line.startswith("| `"):
            rows[line.split("`")[1]] = line
    return rows


def undocumented(text: str, model: type[BaseModel] = GatewaydConfig) -> list[str]:
    """Settings (and nested fields) ``text`` does not document; a setting whose row does
    not name its variable counts as undocumented too."""
    rows = documented_rows(text)
    top = _settings_rows(text)
    missing = []
    for parent, name in field_paths(model):
        if not parent:
            if f"`{env_name(name)}`" not in top.get(name, ""):
                missing.append(name)
            continue
        sections = [h for h in rows if f"`{parent}`" in h]
        if not any(name in rows[h] for h in sections):
            missing.append(f"{parent}.{name}")
    return missing


def test_every_setting_is_documented_with_its_variable() -> None:
    missing = undocumented(DOC.read_text())
    assert not missing, f"docs/configuration.md does not document: {', '.join(missing)}"


@pytest.mark.parametrize("setting", list(GatewaydConfig.model_fields))
def test_the_check_fails_when_a_settings_row_is_removed(setting: str) -> None:
    lines = DOC.read_text().splitlines()
    # Not the rows of a nested setting's own section: one may have a field of the same
    # name (mcp_servers.<name>.secret_env), which stays documented there.
    kept, heading = [], ""
    for line in lines:
        heading = line if line.startswith("#") else heading
        if line.startswith(f"| `{setting}` | ") and ".<name>" not in heading:
            continue
        kept.append(line)
    assert undocumented("\n".join(kept)) == [setting]


def test_the_check_fails_when_a_row_does_not_name_the_variable() -> None:
    text = DOC.read_text().replace("`GATEWAYD_BWRAP`", "`GATEWAYD_BWRAPPER`")
    assert undocumented(text) == ["bwrap"]


@pytest.mark.parametrize(
    ("row", "field"),
    [("| `count` |", "sandbox_uids.count"), ("| `api_key_env` |", "models.<name>.api_key_env")],
)
def test_the_check_fails_when_a_nested_field_is_removed(row: str, field: str) -> None:
    lines = DOC.read_text().splitlines()
    kept = [line for line in lines if not line.startswith(row)]
    assert len(kept) == len(lines) - 1
    assert undocumented("\n".join(kept)) == [field]


def test_the_example_file_is_valid_and_sets_what_it_shows(tmp_path: Path) -> None:
    from gatewayd.configsources import load_config

    text = DOC.read_text()
    section = text[text.index("## An example file") :]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "gatewayd.yaml"
    path.write_text(block)
    config = load_config(path)
    assert config.models["reviewer"].api_key_env == "OPENAI_API_KEY"
    assert config.secret_env == ("FORGE_TOKEN",)
