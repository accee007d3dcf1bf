"""``kthena deploy k8s --config deploy.yaml [--image IMAGE] [--out DIR] [--calibration FILE]``.

Prints the manifests as one multi-document YAML stream, or with ``--out`` writes one file per
object (``networkpolicy.yaml``, ``modelserving.yaml``, ``modelserver.yaml``,
``modelroute.yaml``) and prints their paths.
"""

from __future__ import annotations

import argparse
import os

from kthena_core.cache_dir import default_cache_dir
from kthena_core.calibrate import factors_dict
from kthena_core.calibration_file import CalibrationFile, find_calibration
from kthena_core.deploy.k8s import (
    API_KEY_SECRET_KEY,
    api_key_secret_name,
    pd_secret_name,
    render_manifests,
    to_yaml,
)
from kthena_core.deploy.plan import Deployment, deploy_planner, plan_deployment
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
    k8s.add_argument("--calibration", default=None, metavar="FILE.json",
                     help="plan with this calibration file's factors (`kthena plan --calibrate` "
                          "writes it; 'none': the defaults; default: this machine's cached one "
                          "when the topology is this machine's)")
    k8s.set_defaults(func=_cmd_deploy_k8s)


def header(dep: Deployment, calibration: CalibrationFile | None = None) -> str:
    """The comment at the top of the rendered YAML: the plan, its cost factors, and the
    Secrets the pods need."""
    lines = ["Rendered by `kthena deploy k8s`.", f"plan: {dep.summary()}"]
    if calibration is not None:
        factors = ", ".join(f"{k} {v:.3g}" for k, v in factors_dict(calibration.params).items())
        lines.append(f"cost factors: {factors} (calibration {calibration.path})")
    lines.append(f"needs the Secret {api_key_secret_name(dep)} (key: {API_KEY_SECRET_KEY}) in "
                 f"namespace {dep.spec.namespace}: the API key clients send; see docs/kthena.md")
    if dep.spec.mode == "pd":
        lines.append(f"needs the Secret {pd_secret_name(dep)} (key: secret) in namespace "
                     f"{dep.spec.namespace}; see docs/kthena.md")
    return "\n".join(lines)


def _cmd_deploy_k8s(args: argparse.Namespace) -> int:
    spec = load_deploy_spec(args.config, image=args.image)
    # a deploy file's topology is a catalog node or a YAML file: never this machine's cache
    calibration = find_calibration(args.calibration, default_cache_dir(), this_machine=False)
    dep = plan_deployment(spec, deploy_planner(spec, calibration.params if calibration else None))
    manifests = render_manifests(dep)
    top = header(dep, calibration)
    if args.out is None:
        print(to_yaml(manifests, top), end="")
        return 0
    os.makedirs(args.out, exist_ok=True)
    for manifest in manifests:
        path = os.path.join(args.out, f"{manifest['kind'].lower()}.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(to_yaml([manifest], top))
        print(path)
    return 0
