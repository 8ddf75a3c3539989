"""placement.textfiles: the YAML every config, fleet, catalog and profile file goes through."""

from __future__ import annotations

import math

import pytest

from placement.textfiles import parse_yaml


@pytest.mark.parametrize(
    ("text", "value"),
    [
        pytest.param("1e3", 1000.0, id="exponent without a dot"),
        pytest.param("1.5e3", 1500.0, id="exponent without a sign"),
        pytest.param("-2.5E-1", -0.25, id="negative, capital E"),
        pytest.param(".5e2", 50.0, id="leading dot"),
        pytest.param("1.5e+3", 1500.0, id="YAML 1.1 float, as before"),
        pytest.param("1_000", 1000, id="YAML 1.1 int, as before"),
        pytest.param("'1e3'", "1e3", id="quoted stays a string"),
        pytest.param("12e", "12e", id="not a number stays a string"),
        pytest.param("abc1e3", "abc1e3", id="a name ending in digits stays a string"),
    ],
)
def test_yaml_numbers_read_as_yaml_1_2(text: str, value: object) -> None:
    """PyYAML (YAML 1.1) returned "1e3" and "1.5e3" as strings: `cost_per_hour: 1.5e3` was no number."""
    got = parse_yaml(f"v: {text}\n", ValueError, "bad")["v"]
    assert type(got) is type(value) and got == value


def test_infinity_is_still_read_so_checks_can_refuse_it() -> None:
    assert math.isinf(parse_yaml("v: .inf\n", ValueError, "bad")["v"])


def test_a_syntax_error_is_one_line_with_its_line_number() -> None:
    with pytest.raises(ValueError, match=r"^f.yaml: not valid YAML at line 2$"):
        parse_yaml("a: 1\nb: : c\n", ValueError, "f.yaml: not valid YAML")


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [
        pytest.param(
            "limits:\n  queue_size: 5\nlimits:\n  total_timeout_s: 30\n", 3, "limits", id="two blocks"
        ),
        pytest.param("pools:\n  - name: p\n    tp: 2\n    tp: 4\n", 4, "tp", id="inside a list item"),
    ],
)
def test_a_key_given_twice_is_refused_with_its_line(text: str, line: int, key: str) -> None:
    """PyYAML kept the last of two equal keys silently: a second `limits:` dropped the first's queue_size."""
    with pytest.raises(
        ValueError, match=rf"^f.yaml: not valid YAML at line {line}: key '{key}' is given twice"
    ):
        parse_yaml(text, ValueError, "f.yaml: not valid YAML")


def test_merge_keys_and_equal_keys_in_different_mappings_are_fine() -> None:
    text = "base: &b {a: 1, b: 2}\nx:\n  <<: *b\n  b: 3\ny: {a: 1}\nz: {a: 1}\n"
    assert parse_yaml(text, ValueError, "bad") == {
        "base": {"a": 1, "b": 2}, "x": {"a": 1, "b": 3}, "y": {"a": 1}, "z": {"a": 1}
    }  # fmt: skip
