"""Whole-number fields (GPU offers, Mélange inputs, node inventories) go through one check: a finite whole
number ≥ a minimum, 2.0 read as 2; anything else is one error naming the file and the field."""

from __future__ import annotations

from typing import Any

import pytest

from placement.binpacking import PlacementError
from placement.counts import whole_number
from placement.melange import MelangeFormatError, melange_from_dict
from placement.offers import load_gpu_offers
from placement.topology import TopologyError, nodes_from_dict


@pytest.mark.parametrize(
    ("value", "minimum", "expected"),
    [
        pytest.param(2, 0, 2, id="an int"),
        pytest.param(2.0, 0, 2, id="2.0 reads as 2"),
        pytest.param(0, 0, 0, id="the minimum itself"),
    ],
)
def test_whole_numbers_are_read(value: Any, minimum: int, expected: int) -> None:
    assert whole_number(value, "f.yaml: max", minimum, PlacementError) == expected


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(1.9, id="1.9 is refused, not truncated to 1"),
        pytest.param(float("inf"), id="inf is refused (int() raised OverflowError)"),
        pytest.param(float("nan"), id="nan is refused (int() raised ValueError)"),
        pytest.param(-1, id="below the minimum"),
        pytest.param(True, id="a bool is not a count"),
        pytest.param("abc", id="a string"),
        pytest.param([1], id="a list"),
        pytest.param(None, id="null"),
    ],
)
def test_anything_else_is_one_error_naming_the_field(value: Any) -> None:
    with pytest.raises(PlacementError, match=r"^f\.yaml: max must be a whole number ≥ 0, got "):
        whole_number(value, "f.yaml: max", 0, PlacementError)


def _melange(**gpu: Any) -> dict[str, Any]:
    return {
        "gpu_info": {"A10G": {"cost": 1.01, "tputs": [[2]], **gpu}},
        "workload_distribution": [[1.0]],
        "total_request_rate": 1.0,
    }


def _nodes(cap: Any = None, **node: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"nodes": [{"name": "n", "gpu": "L4", "gpus": 8, **node}]}
    if cap is not None:
        data["max_group_gpus"] = cap
    return data


@pytest.mark.parametrize(
    ("read", "error", "message"),
    [
        pytest.param(
            lambda: load_gpu_offers({"A10G": {"max": float("inf")}}),
            PlacementError,
            "--gpus: GPU A10G: max must be a whole number ≥ 0, got inf",
            id="offers max .inf → one error (was OverflowError)",
        ),
        pytest.param(
            lambda: load_gpu_offers({"A10G": {"max": 1.9}}),
            PlacementError,
            "--gpus: GPU A10G: max must be a whole number ≥ 0, got 1.9",
            id="offers max 1.9 → refused (was 1)",
        ),
        pytest.param(
            lambda: load_gpu_offers({"A10G": {"min": "two"}}),
            PlacementError,
            "--gpus: GPU A10G: min must be a whole number ≥ 0, got 'two'",
            id="offers min a string",
        ),
        pytest.param(
            lambda: load_gpu_offers({None: {}, "A10G": {}}),
            PlacementError,
            "--gpus: GPU name None is not a name; quote it",
            id="a `~:` key (YAML's null) → one error (was a traceback rendering the plan)",
        ),
        pytest.param(
            lambda: load_gpu_offers({True: {}}),
            PlacementError,
            "--gpus: GPU name True is not a name; quote it",
            id="a YAML 1.1 `yes:` key",
        ),
        pytest.param(
            lambda: melange_from_dict(_melange(max_count=float("inf")), "m.json"),
            MelangeFormatError,
            "m.json: gpu_info.A10G.max_count must be a whole number ≥ 0, got inf",
            id="Mélange max_count Infinity → one error (was OverflowError)",
        ),
        pytest.param(
            lambda: melange_from_dict(_melange(max_count=2.7), "m.json"),
            MelangeFormatError,
            "m.json: gpu_info.A10G.max_count must be a whole number ≥ 0, got 2.7",
            id="Mélange max_count 2.7 → refused (was 2)",
        ),
        pytest.param(
            lambda: melange_from_dict({**_melange(), "slice_factor": 1.5}, "m.json"),
            MelangeFormatError,
            "m.json: slice_factor must be a whole number ≥ 1, got 1.5",
            id="Mélange slice_factor 1.5",
        ),
        pytest.param(
            lambda: nodes_from_dict(_nodes(gpus=float("inf")), "n.yaml"),
            TopologyError,
            r"n.yaml: nodes\[0\].gpus must be a whole number ≥ 1, got inf",
            id="node gpus .inf → one error (was OverflowError)",
        ),
        pytest.param(
            lambda: nodes_from_dict(_nodes(gpus=8.5), "n.yaml"),
            TopologyError,
            r"n.yaml: nodes\[0\].gpus must be a whole number ≥ 1, got 8.5",
            id="node gpus 8.5 → refused (was 8)",
        ),
        pytest.param(
            lambda: nodes_from_dict(_nodes(used=-1), "n.yaml"),
            TopologyError,
            r"n.yaml: nodes\[0\].used must be a whole number ≥ 0, got -1",
            id="node used -1",
        ),
        *(
            pytest.param(
                lambda cap=cap: nodes_from_dict(_nodes(cap), "n.yaml"),
                TopologyError,
                f"n.yaml: max_group_gpus must be a whole number ≥ 1, got {text}",
                id=f"max_group_gpus {text} → one error (was unguarded)",
            )
            for cap, text in (("abc", "'abc'"), ([1], r"\[1\]"), (float("nan"), "nan"), (0, "0"))
        ),
    ],
)
def test_each_reader_refuses_a_bad_count_with_one_error(
    read: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{message}$"):
        read()


def test_each_reader_accepts_a_whole_float() -> None:
    assert load_gpu_offers({"A10G": {"min": 1.0, "max": 2.0}})["A10G"].max_gpus == 2


def test_a_gpu_name_yaml_reads_as_a_number_is_that_name() -> None:
    """`4090: {cost_per_hour: 0.4}`: YAML reads the key as the integer 4090; the plan's table then failed to
    render it (a rich traceback) and a node of GPU 4090 never matched it."""
    offers = load_gpu_offers({4090: {"cost_per_hour": 0.4}})
    assert list(offers) == ["4090"] and offers["4090"].cost_per_hour == 0.4
    offer = melange_from_dict({**_melange(max_count=3.0), "slice_factor": 2.0}).problem.gpus["A10G"]
    assert offer.max_gpus == 3
    nodes, cap, _ = nodes_from_dict(_nodes(4.0, gpus=8.0, used=2.0))
    assert (nodes[0].gpus, nodes[0].used, cap) == (8, 2, 4)
