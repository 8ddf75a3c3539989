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
