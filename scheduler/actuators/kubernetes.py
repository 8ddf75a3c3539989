"""Kubernetes actuator: each pool is a Deployment; scaling patches its `scale` subresource.

RBAC it needs, in the release namespace only (the Helm chart's controller Role):
`apps/deployments/scale: get, patch` (and `pods`, `discovery.k8s.io/endpointslices: get, list, watch` for
discovery). Scale-in is soft because the gateway stops routing to terminating endpoints at once and the
chart gives vLLM pods a preStop drain and a termination grace period, so in-flight streams finish.

Topology (`autoscaler.nodes`): the scale subresource sets a count and cannot choose nodes, so this
actuator receives only the (clipped) counts; the controller keeps the placement it computed as advice
(`/admin/autoscaler`, decision records). docs/autoscaling-live.md shows how to make the cluster follow it
(one Deployment per pool and domain, or pod affinity on the domain label).

The `kubernetes` client is an optional extra (`pip install mosaic-serve[k8s]`); the API object is injected
so tests can record the exact calls against canned API responses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scheduler.actuators.base import ScaleAction


class KubernetesActuator:
    def __init__(self, apps_api: Any, namespace: str, deployments: Mapping[str, str]) -> None:
        """`apps_api` is a `kubernetes.client.AppsV1Api`; `deployments` maps pool name → Deployment name."""
        self._api = apps_api
        self._namespace = namespace
        self._deployments = dict(deployments)

    @classmethod
    def from_environment(cls, namespace: str, deployments: Mapping[str, str]) -> KubernetesActuator:
        """In-cluster config when running in a pod, else the local kubeconfig."""
        try:
            from kubernetes import client, config
        except ImportError as exc:  # pragma: no cover - depends on the optional extra
            raise RuntimeError("the kubernetes actuator needs the 'k8s' extra: pip install 'mosaic-serve[k8s]'") from exc
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.AppsV1Api(), namespace, deployments)

    def _deployment(self, pool: str) -> str:
        try:
            return self._deployments[pool]
        except KeyError:
            raise KeyError(f"pool {pool!r} has no Deployment configured") from None

    def replicas(self, pool: str) -> int:
        scale = self._api.read_namespaced_deployment_scale(self._deployment(pool), self._namespace)
        return int(scale.spec.replicas or 0)

    def scale(self, pool: str, replicas: int, now: float) -> ScaleAction:
        if replicas < 0:
            raise ValueError(f"replicas must be ≥ 0, got {replicas}")
        name = self._deployment(pool)
        before = -1
        try:
            before = self.replicas(pool)
            if before == replicas:
                return ScaleAction(now, pool, before, replicas, applied=True)
            self._api.patch_namespaced_deployment_scale(name, self._namespace, {"spec": {"replicas": replicas}})
        except Exception as exc:  # ApiException and transport errors: report, the next cycle retries
            status = getattr(exc, "status", None)
            reason = getattr(exc, "reason", None) or type(exc).__name__
            return ScaleAction(now, pool, before, before, applied=False, error=f"{status or ''} {reason}".strip())
        return ScaleAction(now, pool, before, replicas, applied=True)
