"""Actuators: the Kubernetes one against the real client with recorded API responses, and dry-run."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client

from scheduler.actuators.base import ActuatorCallFailed
from scheduler.actuators.dry_run import DryRunActuator
from scheduler.actuators.kubernetes import KubernetesActuator


class _Recorded:
    """A urllib3-style response, as the kubernetes REST layer hands it to the deserialiser."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self.reason = "OK" if status < 400 else "Forbidden"
        self.data = json.dumps(body).encode()
        self.headers = {"content-type": "application/json"}

    def read(self) -> bytes:
        return self.data

    def getheaders(self) -> dict[str, str]:
        return self.headers

    def getheader(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name, default)


def _forbidden(method: str, name: str) -> dict[str, Any]:
    """The API server's 403 `Status` for the controller's service account without RBAC for the call."""
    verb = "get" if method == "GET" else "patch"
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": f'deployments.apps "{name}" is forbidden: User "system:serviceaccount:llm:mosaic-controller" '
        f'cannot {verb} resource "deployments/scale" in API group "apps" in the namespace "llm"',
        "reason": "Forbidden",
        "details": {"name": name, "group": "apps", "kind": "deployments"},
        "code": 403,
    }


def _scale_object(name: str, replicas: int) -> dict[str, Any]:
    # what `kubectl get --raw /apis/apps/v1/namespaces/llm/deployments/<name>/scale` returns
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {"name": name, "namespace": "llm", "resourceVersion": "4711"},
        "spec": {"replicas": replicas},
        "status": {"replicas": replicas, "selector": f"mosaic.dev/pool={name}"},
    }


@pytest.fixture
def k8s() -> Any:
    api_client = client.ApiClient(client.Configuration(host="https://k8s.test"))
    calls: list[tuple[str, str, Any]] = []
    state = {"vllm-decode-a100": 2}
    forbidden = {"vllm-forbidden"}

    def request(
        method: str,
        url: str,
        headers: Any = None,
        body: Any = None,
        post_params: Any = None,
        _request_timeout: Any = None,
    ) -> Any:
        calls.append((method, url, body))
        name = url.split("/deployments/")[1].split("/")[0]
        if name in forbidden:
            from kubernetes.client.rest import RESTResponse

            return RESTResponse(_Recorded(403, _forbidden(method, name)))
        if method == "PATCH":
            state[name] = body["spec"]["replicas"]
        from kubernetes.client.rest import RESTResponse

        return RESTResponse(_Recorded(200, _scale_object(name, state.get(name, 0))))

    api_client.rest_client.request = request
    yield client.AppsV1Api(api_client), calls, state
    api_client.close()


def test_kubernetes_actuator_patches_the_scale_subresource(k8s: Any) -> None:
    apps, calls, state = k8s
    actuator = KubernetesActuator(apps, "llm", {"decode-a100": "vllm-decode-a100"})
    assert actuator.replicas("decode-a100") == 2
    action = actuator.scale("decode-a100", 5, now=30.0)
    assert (action.before, action.after, action.applied) == (2, 5, True)
    assert state["vllm-decode-a100"] == 5
    method, url, body = calls[-1]
    assert method == "PATCH"
    # as its own field manager, so GitOps tools can leave the replicas it owns alone (docs/deploy.md)
    assert url == (
        "https://k8s.test/apis/apps/v1/namespaces/llm/deployments/vllm-decode-a100/scale"
        "?fieldManager=mosaic-autoscaler"
    )
    assert body == {"spec": {"replicas": 5}}


def test_kubernetes_actuator_same_count_sends_no_patch(k8s: Any) -> None:
    apps, calls, _ = k8s
    actuator = KubernetesActuator(apps, "llm", {"decode-a100": "vllm-decode-a100"})
    actuator.scale("decode-a100", 2, now=0.0)
    assert [c[0] for c in calls] == ["GET"]


def test_kubernetes_actuator_reports_refusal_without_raising(k8s: Any) -> None:
    apps, _, _ = k8s
    actuator = KubernetesActuator(apps, "llm", {"p": "vllm-forbidden"})
    # the error names the Deployment, the namespace and the API server's reason (here RBAC's), which an
    # operator needs to fix it
    with pytest.raises(ActuatorCallFailed) as raised:
        actuator.replicas("p")
    assert str(raised.value) == (
        "reading deployments/vllm-forbidden/scale in namespace llm: 403 Forbidden: "
        + _forbidden("GET", "vllm-forbidden")["message"]
    )
    action = actuator.scale("p", 3, now=5.0)
    assert (action.applied, action.error) == (False, str(raised.value))
    with pytest.raises(KeyError, match="no Deployment configured"):
        actuator.scale("unknown", 1, now=0.0)


def test_dry_run_records_and_remembers() -> None:
    actuator = DryRunActuator({"d": 2})
    action = actuator.scale("d", 4, now=10.0)
    assert (action.before, action.after, action.applied) == (2, 4, False)
    assert actuator.replicas("d") == 4
    assert list(actuator.actions) == [action]
