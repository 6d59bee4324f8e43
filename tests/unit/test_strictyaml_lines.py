"""Where a YAML problem is: ``YamlInputError`` carries its line, column and problem apart
(so YAML embedded in a larger file, an app's front matter, names the file's line), and
``key_lines`` gives each key's line for validation errors."""

from __future__ import annotations

import pytest

from gatewayd import strictyaml


@pytest.mark.parametrize(
    ("text", "line", "column", "problem"),
    [
        ("a: 1\na: 2\n", 2, 1, "YAML syntax: found a key twice in one mapping"),
        ("a: 1\nb: [\n", 3, 1, "YAML syntax: "),
        ("a: 1\nb: &x 1\n", 2, 4, "anchors and aliases"),
        ("a:\n  b: " + "[" * 40, 2, 36, "nested more than 32 levels deep"),
        ("a: " + "9" * 5000, 1, 4, "a number of more than 4300 digits"),
    ],
)
def test_an_error_carries_its_line_column_and_problem(
    text: str, line: int, column: int, problem: str
) -> None:
    with pytest.raises(strictyaml.YamlInputError) as caught:
        strictyaml.load(text)
    error = caught.value
    assert (error.line, error.column) == (line, column)
    assert error.problem.startswith(problem)
    # The message is what it always was: the position, then the problem.
    assert str(error) == f"line {line}, column {column}: {error.problem}"


def test_key_lines_names_every_key_and_list_item_by_its_path() -> None:
    text = "name: x\nlimits:\n  turns: 5\n  tokens: 9\nallow:\n  - a\n  - {k: v}\n"
    assert strictyaml.key_lines(text) == {
        ("name",): 1,
        ("limits",): 2,
        ("limits", "turns"): 3,
        ("limits", "tokens"): 4,
        ("allow",): 5,
        ("allow", 0): 6,
        ("allow", 1): 7,
        ("allow", 1, "k"): 7,
    }


def test_key_lines_of_no_document_is_empty() -> None:
    assert strictyaml.key_lines("") == {}
    assert strictyaml.key_lines("a: [") == {}
