"""Render the Helm chart offline with the Helm library itself (helm-python-sdk binds libhelm_c, Helm v4's Go
SDK compiled to a shared library shipped in the wheel: no `helm` binary, no network) and look objects up.

Used by the chart tests; nothing here talks to a cluster. `lookup` returns nothing offline, so renders are
those of a first install.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import typer
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "mosaic"
EXAMPLES_DIR = CHART_DIR / "examples"
FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"
RELEASE = "mosaic"
NAMESPACE = "llm"

# Kinds the Prometheus operator and the Gateway API define as CRDs: kubernetes-validate ships only the
# built-in API's OpenAPI schemas, so these are checked by structure (tests/chart/test_chart_structure.py;
# PrometheusRule: tests/chart/test_chart_alerts.py).
CRD_KINDS = frozenset({"ServiceMonitor", "PodMonitor", "PrometheusRule", "HTTPRoute"})

# Label values: ≤ 63 chars, alphanumeric at both ends, `-_.` inside (Kubernetes' validation.IsValidLabelValue).
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def example_files() -> list[Path]:
    return sorted(EXAMPLES_DIR.glob("*.yaml"))


def load_values(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text()) or {}
    assert isinstance(data, dict), f"{path} must hold a mapping"
    return data


@dataclass(frozen=True)
class Rendered:
    """One render: the parsed objects (with the template each came from) and NOTES.txt."""

    objects: tuple[dict[str, Any], ...]
    sources: tuple[str, ...]
    notes: str

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def find(self, kind: str, name: str) -> dict[str, Any] | None:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        return found[0] if found else None

    def pool_deployments(self) -> list[dict[str, Any]]:
        return [d for d in self.of_kind("Deployment") if "mosaic.dev/pool" in d["metadata"]["labels"]]

    def deployments_of_pool(self, pool: str) -> list[dict[str, Any]]:
        """The pool's Deployments: one, or one per network domain (`pools[].domains`)."""
        return [d for d in self.pool_deployments() if d["metadata"]["labels"]["mosaic.dev/pool"] == pool]

    def config_text(self) -> str:
        return self.get("ConfigMap", f"{RELEASE}-config")["data"]["config.yaml"]

    def load_config(self, into: Path) -> Any:
        """The ConfigMap's files written to `into` as the pod mounts them, loaded by Mosaic's `load_config`."""
        from server.config import load_config

        for name, text in self.get("ConfigMap", f"{RELEASE}-config")["data"].items():
            (into / name).write_text(text.replace("/etc/mosaic/", f"{into}/"))
        return load_config(into / "config.yaml")

    def config(self) -> dict[str, Any]:
        data = yaml.safe_load(self.config_text())
        assert isinstance(data, dict)
        return data


def with_decode(pool: dict[str, Any]) -> list[dict[str, Any]]:
    """`pool`, and for a prefill pool a decode pool of its model after it: a model with prefill pools only is
    refused at render (nothing would finish its requests), so a test about a prefill pool renders a P/D pair."""
    if pool.get("role") != "prefill":
        return [pool]
    return [
        pool,
        {"name": f"{pool['name']}-decode", "model": pool["model"], "gpu": pool["gpu"], "role": "decode"},
    ]


# libyaml's safe loader where PyYAML was built with it: the same objects, ~6x faster (most of a render's time)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def render(chart: helm.Chart, values: dict[str, Any] | None = None) -> Rendered:
    manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects: list[dict[str, Any]] = []
    sources: list[str] = []
    notes = ""
    for template, text in sorted(manifests.items()):
        if template.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.load_all(text, Loader=SAFE_LOADER):
            if doc:
                objects.append(doc)
                sources.append(template)
    return Rendered(tuple(objects), tuple(sources), notes)


def refusal(chart: helm.Chart, values: dict[str, Any]) -> str:
    """The message a render refuses `values` with: the schema's, or a template's `fail`."""
    with pytest.raises(helm.HelmError) as caught:
        render(chart, values)
    return str(caught.value)


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def container(deployment: dict[str, Any], index: int = 0) -> dict[str, Any]:
    c: dict[str, Any] = pod_spec(deployment)["containers"][index]
    return c


# The oldest Kubernetes the chart supports and the newest kubernetes-validate knows.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())


def container_args(deployment: dict[str, Any]) -> list[str]:
    """The first container's args, as strings."""
    return [str(a) for a in container(deployment)["args"]]


def validated_deployment(rendered: Rendered, name: str) -> dict[str, Any]:
    """The release's Deployment `<release>-<name>`, validated (strict) against each of KUBE_VERSIONS."""
    dep = rendered.get("Deployment", f"{RELEASE}-{name}")
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(dep, version, strict=True)
    return dep


def env_map(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env") or []}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """A matchLabels/Service selector selects `labels` when every pair is present."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def label_selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector (`matchLabels` and `matchExpressions`, as monitors and PDBs carry it) selects
    `labels`: every pair present and every expression true. An empty selector selects nothing here (the chart
    never writes one; Kubernetes would read it as everything)."""
    pairs = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or []
    if not pairs and not expressions:
        return False
    checks = {
        "In": lambda key, values: labels.get(key) in values,
        "NotIn": lambda key, values: labels.get(key) not in values,
        "Exists": lambda key, _: key in labels,
        "DoesNotExist": lambda key, _: key not in labels,
    }
    return all(labels.get(k) == v for k, v in pairs.items()) and all(
        checks[e["operator"]](e["key"], e.get("values") or []) for e in expressions
    )


def parse_selector(text: str) -> dict[str, str]:
    """`k=v,k=v` (equality-based label selector, the only form the chart writes) → dict."""
    pairs = [p.split("=", 1) for p in text.split(",")]
    assert all(len(p) == 2 for p in pairs), f"not an equality selector: {text}"
    return {k: v for k, v in pairs}


def walk_labels(obj: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """Every label of an object and of its pod template, if any."""
    yield from (obj["metadata"].get("labels") or {}).items()
    template = (obj.get("spec") or {}).get("template")
    if isinstance(template, dict):
        yield from ((template.get("metadata") or {}).get("labels") or {}).items()


@functools.cache
def _mosaic_commands() -> dict[str, Any] | str:
    """The real `mosaic` sub-commands by name (Typer's click objects), or why the CLI cannot be built yet."""
    try:
        from server.cli import build_app

        command = typer.main.get_command(build_app())
    except ImportError as exc:
        return f"the mosaic CLI does not build yet: {exc}"
    # A group has `.commands`; Typer collapses an app with a single command into that command.
    commands = getattr(command, "commands", None)
    return dict(commands) if commands is not None else {command.name or "": command}


def parse_mosaic_args(args: list[str]) -> dict[str, Any]:
    """Parse `mosaic <args>` with Mosaic's own CLI (click parses, nothing runs): an unknown flag or a bad
    value fails the test. Returns the parsed parameters by name. Skips while the sub-command is not
    registered yet."""
    return parse_mosaic_line(args)[0]


def parse_mosaic_line(args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """`parse_mosaic_args`, and the arguments click left to the command itself (`ctx.args`: `mosaic worker`
    reads vLLM's LoRA flags from them)."""
    commands = _mosaic_commands()
    if isinstance(commands, str):
        pytest.skip(commands)
    sub = commands.get(args[0])
    if sub is None:
        pytest.skip(f"`mosaic {args[0]}` is not registered in server/cli.py yet")
    with sub.make_context(args[0], list(args[1:])) as ctx:
        assert ctx.params
        return dict(ctx.params), list(ctx.args)
