"""gatewayd's configuration file: model aliases, validated with errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from gatewayd.config import ConfigError, GatewaydConfig
from gatewayd.configsources import load_config

GOOD = """
models:
  reviewer:
    provider: openai
    model: gpt-4o-mini
    api_base: http://127.0.0.1:11434/v1/
    api_key_env: OPENAI_API_KEY
    timeout_s: 20
  local:
    provider: ollama
    model: llama3
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gatewayd.yaml"
    path.write_text(text)
    return path


def test_a_valid_file_gives_aliases_with_their_litellm_route(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))
    reviewer = config.models["reviewer"]
    assert reviewer.litellm_model == "openai/gpt-4o-mini"
    assert reviewer.api_base == "http://127.0.0.1:11434/v1"  # trailing / dropped
    assert reviewer.api_key_env == "OPENAI_API_KEY" and reviewer.timeout_s == 20
    assert config.models["local"].api_base is None and config.models["local"].timeout_s == 60


def test_an_empty_file_is_an_empty_configuration(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == GatewaydConfig()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("models: {r: {provider: openai}}", "models.r.model: Field required"),
        ("models: {r: {provider: OpenAI, model: m}}", "models.r.provider: Value error, provider"),
        ("models: {r: {provider: openai, model: m, api_base: ftp://x}}", "must be an http://"),
        ("models: {r: {provider: openai, model: m, api_key_env: 'A-B'}}", "api_key_env 'A-B'"),
        ("models: {r: {provider: openai, model: m, timeout_s: 0}}", "greater than 0"),
        ("models: {r: {provider: openai, model: m, key: sk-123}}", "models.r.key: Extra inputs"),
        ("models: {'bad alias': {provider: openai, model: m}}", "model alias 'bad alias'"),
        ("secrets: {}", "secrets: Extra inputs are not permitted"),
        ("models: [1, 2]", "models: Input should be a valid dictionary"),
        ("models: {r: {provider: openai, model: m", "not valid YAML"),
    ],
)
def test_a_bad_file_names_the_file_and_the_field(tmp_path: Path, text: str, says: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert says in str(caught.value)


def test_a_missing_file_is_refused_with_its_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the configuration: No such file"):
        load_config(tmp_path / "absent.yaml")
