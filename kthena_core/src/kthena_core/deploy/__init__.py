"""Deployment manifests from a plan: ``kthena deploy k8s`` renders Kthena's custom resources.

`load_deploy_spec` reads and checks a deploy.yaml (spec.py), `plan_deployment` runs the planner
and cuts its layout into worker pods (plan.py), and `render_manifests` turns that into the
ModelServing, ModelServer and ModelRoute objects of volcano-sh/kthena and a NetworkPolicy that
guards the worker pods (k8s.py), plain dicts that `to_yaml` writes out. Nothing here talks to a cluster.
"""

from kthena_core.deploy.k8s import (
    render_manifests,
    render_model_route,
    render_model_server,
    render_model_serving,
    render_network_policy,
    to_yaml,
)
from kthena_core.deploy.plan import Deployment, Role, plan_deployment
from kthena_core.deploy.spec import DeployError, DeploySpec, load_deploy_spec

__all__ = [
    "DeployError",
    "DeploySpec",
    "Deployment",
    "Role",
    "load_deploy_spec",
    "plan_deployment",
    "render_manifests",
    "render_model_route",
    "render_model_server",
    "render_model_serving",
    "render_network_policy",
    "to_yaml",
]
