"""`mosaic simulate`'s human-readable summary: a `topology` row when the report has a topology section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from server.cli import build_app
from server.commands.simulate import topology_summary

REPO = Path(__file__).resolve().parents[2]
LINKS = {"kv_link_gbps": 25.0, "kv_link_cross_domain_gbps": 6.25}


@pytest.mark.parametrize(
    ("topology", "expected"),
    [
        pytest.param(
            {
                **LINKS,
                "kv_transfers": {"intra_domain": 13906, "cross_domain": 2858},
                "nodes": 4,
                "domains": ["rack-1", "rack-2"],
                "max_cross_domain_pairs": 12,
                "shortfalls": [{}, {}],
            },
            # 2,858 / 16,764 = 17.05%
            "2858 of 16764 KV transfers across domains (17.0%); links 25 GB/s within, 6.25 GB/s across; "
            "4 nodes in 2 domains, max 12 cross-domain P/D pairs, 2 clipped scale-ups",
            id="with a node inventory: nodes, domains, worst pairs, clipped scale-ups",
        ),
        pytest.param(
            {**LINKS, "kv_transfers": {"intra_domain": 0, "cross_domain": 40}},
            "40 of 40 KV transfers across domains (100.0%); links 25 GB/s within, 6.25 GB/s across",
            id="pool domains only (no inventory): transfers and links",
        ),
        pytest.param(
            {**LINKS, "kv_transfers": {"intra_domain": 0, "cross_domain": 0}},
            "0 of 0 KV transfers across domains; links 25 GB/s within, 6.25 GB/s across",
            id="no P/D transfer at all: no share",
        ),
    ],
)
def test_topology_summary(topology: dict, expected: str) -> None:
    assert topology_summary(topology) == expected


def test_cli_summary_has_a_topology_row_only_with_topology(tmp_path: Path) -> None:
    trace = ["--trace", "synthetic:rate=4,n=60,input=800,output=50", "--policy", "fixed"]
    with_nodes = CliRunner().invoke(
        build_app(), ["simulate", *trace, "--fleet", str(REPO / "docs/examples/fleet-pd-topology.yaml")]
    )
    assert with_nodes.exit_code == 0, with_nodes.output
    assert "topology" in with_nodes.output and "KV transfers across domains" in with_nodes.output
    plain = tmp_path / "fleet.json"
    plain.write_text(
        json.dumps(
            {
                "model": "llama-3-8b",
                "pools": [
                    {"name": "p", "gpu": "H100", "role": "prefill"},
                    {"name": "d", "gpu": "A100-80GB", "role": "decode"},
                ],
            }
        )
    )
    without = CliRunner().invoke(build_app(), ["simulate", *trace, "--fleet", str(plain)])
    assert without.exit_code == 0, without.output
    assert "KV transfers across domains" not in without.output
