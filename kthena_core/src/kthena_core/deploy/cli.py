"""``kthena deploy k8s --config deploy.yaml [--image IMAGE] [--out DIR]``.

Prints the manifests as one multi-document YAML stream, or with ``--out`` writes one file per
object (``modelserving.yaml``, ``modelserver.yaml``, ``modelroute.yaml``) and prints their paths.
"""

from __future__ import annotations

import argparse
import os

from kthena_core.deploy.k8s import pd_secret_name, render_manifests, to_yaml
from kthena_core.deploy.plan import Deployment, plan_deployment
from kthena_core.deploy.spec import load_deploy_spec

__all__ = ["add_deploy_parser"]


def add_deploy_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``kthena deploy`` (with its one target, ``k8s``) to the ``kthena`` command."""
    deploy = subparsers.add_parser("deploy", help="render deployment manifests from a plan")
    targets = deploy.add_subparsers(dest="deploy_target", required=True)
    k8s = targets.add_parser("k8s", help="Kthena ModelServing / ModelServer / ModelRoute YAML")
    k8s.add_argument("--config", required=True, help="deploy.yaml (docs/kthena.md lists its keys)")
    k8s.add_argument("--image", default=None, help="worker image (overrides the file's image)")
    k8s.add_argument("--out", default=None,
                     help="write one YAML file per object into this folder instead of stdout")
    k8s.set_defaults(func=_cmd_deploy_k8s)


def header(dep: Deployment) -> str:
    """The comment at the top of the rendered YAML: the plan, and the Secret PD needs."""
    lines = ["Rendered by `kthena deploy k8s`.", f"plan: {dep.summary()}"]
    if dep.spec.mode == "pd":
        lines.append(f"needs the Secret {pd_secret_name(dep)} (key: secret) in namespace "
                     f"{dep.spec.namespace}; see docs/kthena.md")
    return "\n".join(lines)


def _cmd_deploy_k8s(args: argparse.Namespace) -> int:
    dep = plan_deployment(load_deploy_spec(args.config, image=args.image))
    manifests = render_manifests(dep)
    if args.out is None:
        print(to_yaml(manifests, header(dep)), end="")
        return 0
    os.makedirs(args.out, exist_ok=True)
    for manifest in manifests:
        path = os.path.join(args.out, f"{manifest['kind'].lower()}.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(to_yaml([manifest], header(dep)))
        print(path)
    return 0
