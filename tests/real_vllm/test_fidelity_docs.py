"""docs/real_vllm.md lists every known fidelity difference the diff test tolerates (runs everywhere)."""

from __future__ import annotations

import re

import pytest
import vllm_env
from fidelity import (
    KNOWN_BODY,
    KNOWN_DIFFERENTIAL,
    KNOWN_ERRORS,
    KNOWN_METRIC_FAMILIES,
    KNOWN_METRIC_LABELS,
    KNOWN_STREAM,
)

DOC = (vllm_env.REPO_ROOT / "docs" / "real_vllm.md").read_text(encoding="utf-8")


def field_name(key: str) -> str:
    """`chat .choices[].message.refusal: null vs absent` → `refusal`."""
    path = key.split(" ")[-4] if " vs " in key else key
    return re.sub(r"\[\]", "", path.rstrip(":")).rsplit(".", 1)[-1]


FIELD_KEYS = (
    sorted(KNOWN_BODY) + sorted(KNOWN_STREAM) + sorted(k for k in KNOWN_DIFFERENTIAL if " error: " not in k)
)


@pytest.mark.parametrize("key", sorted(k for k in KNOWN_DIFFERENTIAL if " error: " in k))
def test_differential_error_difference_is_documented(key: str) -> None:
    """An error difference of the random requests is in the docs word for word."""
    assert f"`{key}`" in DOC, key


@pytest.mark.parametrize("key", FIELD_KEYS)
def test_field_difference_is_documented(key: str) -> None:
    assert f"{field_name(key)}`" in DOC or f".{field_name(key)}" in DOC, key


def test_error_differences_are_documented() -> None:
    """Each listed error difference has its row; with none listed the docs say so."""
    for key in KNOWN_ERRORS:
        case, _, values = key.partition(": ")
        assert f"| {case}: {values} |" in DOC, key
    assert bool(KNOWN_ERRORS) != ("Errors: none." in DOC)


@pytest.mark.parametrize("key", sorted(KNOWN_METRIC_FAMILIES))
def test_metric_family_difference_is_documented(key: str) -> None:
    assert f"`{key.split(':')[1]}`" in DOC or f"`vllm:{key.split(':')[1]}`" in DOC, key


@pytest.mark.parametrize("key", sorted(KNOWN_METRIC_LABELS))
def test_metric_label_difference_is_documented(key: str) -> None:
    family, _, what = key.partition(" ")
    assert f"`{family}` {what.replace('model_name', '`model_name`')}" in DOC, key
