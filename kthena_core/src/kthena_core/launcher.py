"""``kthena-run``: a thin wrapper over ``torch.distributed.run`` (torchrun) driven by a config.

It reads a ``kthena_config.yaml`` (or flags), fills torchrun's rendezvous arguments from the
``cluster`` section, and exports the environment every rank needs before torchrun forks them:
the collective backend (``KTHENA_DIST_BACKEND``:
hccl | nccl | gloo), and on CPU one OpenMP thread pool per rank sized to its share of the cores
with ``OMP_WAIT_POLICY=PASSIVE`` (spin-waiting pools on shared cores collapse throughput).
torchrun itself sets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT per rank.

On Ascend (backend hccl) it also exports HCCL's launch variables (``kthena_core.hccl_env``):
HCCL_CONNECT_TIMEOUT always, HCCL_IF_IP / HCCL_SOCKET_IFNAME / RANK_TABLE_FILE when given (by
flag or by the user's environment), and refuses a launch they do not fit, saying why: several
nodes with neither NIC variable, an HCCL_IF_IP that is not this host's, a NIC name that matches
nothing here, a rank table that is missing or lists another number of devices.

torch is imported lazily, only to hand over to torchrun, so kthena_core stays torch-free.

On CPU across nodes (backend gloo, ``--nnodes`` > 1) it sets ``GLOO_SOCKET_IFNAME``, unless the
user did, to the interface the other nodes reach this one by: the one holding ``master_addr`` on
the master node, else the one the route to ``master_addr`` leaves by. Gloo would otherwise bind
whatever address the host name resolves to, often loopback or an address of another network.

Inside a Kthena serving group (``--serving-group``: the pods ``kthena deploy k8s`` renders for
an engine larger than a node) the master address, node rank and node count come from the
variables Kthena injects, ENTRY_ADDRESS, WORKER_INDEX and GROUP_SIZE (``serving_group.py``).

The script ``serve`` is ``kthena serve`` on every rank (``python -m kthena_core.cli serve``):
rank 0 serves the API, the other ranks run its steps. The script ``pd-worker`` is a PD worker
on every rank (``python -m kthena_serve.pd.worker``): a prefill or decode instance larger than
a node.

Example::

    kthena-run --config kthena_config.yaml --nproc_per_node 4 serve.py --port 8000
    kthena-run --nnodes 2 --node_rank 0 --nproc_per_node 4 --master_addr 10.0.0.1 \\
               --master_port 29500 serve.py
    kthena-run --nnodes 2 --node_rank 1 --nproc_per_node 1 --master_addr 10.0.0.1 --pp 2 \\
               serve --pp 2
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

from kthena_core.config import ConfigError, KthenaConfig, load_config
from kthena_core.hccl_env import HcclSettings, check_hccl, hccl_environment
from kthena_core.serving_group import ServingGroup

BACKENDS = ("auto", "hccl", "nccl", "gloo")
# Named programs every rank may run: ``serve`` is ``kthena serve``; ``pd-worker`` is one PD
# worker (``python -m kthena_serve.pd.worker``: a prefill or decode instance larger than a node,
# which kthena deploy k8s renders as a serving group).
SCRIPTS = {"serve": ["--module", "kthena_core.cli", "serve"],
           "pd-worker": ["--module", "kthena_serve.pd.worker"]}


def detect_backend() -> str:
    """hccl when an Ascend runtime is visible, nccl when an NVIDIA driver is, else gloo.

    Looks for the vendor tools/devices only; imports neither torch_npu nor CUDA.
    """
    if shutil.which("npu-smi") or os.path.exists("/dev/davinci_manager"):
        return "hccl"
    if shutil.which("nvidia-smi") or os.path.exists("/dev/nvidiactl"):
        return "nccl"
    return "gloo"


def gloo_interface(master_addr: str) -> str | None:
    """The network interface other nodes reach this one by (see the module docs), or None when
    ``ip`` cannot tell (no iproute2, an unresolvable name)."""
    try:
        address = socket.gethostbyname(master_addr)
        ipaddress.ip_address(address)
        shown = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                               text=True, timeout=10)
        for line in shown.stdout.splitlines():
            found = re.match(r"\d+:\s+(\S+)\s+inet\s+([\d.]+)/", line)
            if found and found.group(2) == address:
                return found.group(1)
        route = subprocess.run(["ip", "-o", "route", "get", address], capture_output=True,
                               text=True, timeout=10)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    found = re.search(r"\bdev\s+(\S+)", route.stdout)
    return found.group(1) if found else None


def rank_environment(cfg: KthenaConfig, backend: str, nproc_per_node: int,
                     num_cpus: int | None = None, hccl: HcclSettings | None = None,
                     gloo_ifname: str | None = None) -> dict[str, str]:
    """Environment variables common to every rank this launcher starts.

    ``hccl``: HCCL's variables (backend hccl); None keeps only a user's HCCL_CONNECT_TIMEOUT
    (default 600 s), since addresses of the machine that writes a manifest are not the pods'.
    ``gloo_ifname``: GLOO_SOCKET_IFNAME for a gloo launch across nodes (`gloo_interface`).
    """
    # No layout variables (KTHENA_TP_SIZE ...): nothing read them. A script takes its layout
    # from its own flags (``kthena serve --tp N`` or ``--config``), and torchrun's WORLD_SIZE.
    env = {"KTHENA_DIST_BACKEND": backend}
    if backend == "gloo":
        cores = num_cpus or os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cores // max(1, nproc_per_node)))
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        if gloo_ifname:
            env["GLOO_SOCKET_IFNAME"] = gloo_ifname
    if backend == "hccl":
        if hccl is None:
            timeout = os.environ.get("HCCL_CONNECT_TIMEOUT")
            hccl = HcclSettings.from_environ({"HCCL_CONNECT_TIMEOUT": timeout} if timeout else {})
        env.update(hccl_environment(hccl))
    return env


def hccl_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> HcclSettings:
    """HCCL's variables from the user's environment, flags taking precedence."""
    return HcclSettings.from_environ(environ, if_ip=args.hccl_if_ip,
                                     socket_ifname=args.hccl_socket_ifname,
                                     connect_timeout_s=args.hccl_connect_timeout,
                                     rank_table_file=args.rank_table_file)


def torchrun_argv(cfg: KthenaConfig, args: argparse.Namespace) -> list[str]:
    """The argument list handed to torch.distributed.run."""
    cl = cfg.cluster
    nnodes = args.nnodes or cl.nnodes
    nproc = args.nproc_per_node or max(1, cl.world_size // nnodes)
    if nnodes * nproc != cl.world_size and args.config:
        raise ConfigError(
            f"--nnodes {nnodes} x --nproc_per_node {nproc} = {nnodes * nproc} ranks, but "
            f"cluster.world_size is {cl.world_size}; make them agree"
        )
    return [
        f"--nnodes={nnodes}",
        f"--node_rank={args.node_rank if args.node_rank is not None else cl.node_rank}",
        f"--nproc_per_node={nproc}",
        f"--master_addr={args.master_addr or cl.master_addr}",
        f"--master_port={args.master_port or cl.master_port}",
        *SCRIPTS.get(args.script, [args.script]),
        *args.script_args,
    ]


def _config_from_args(args: argparse.Namespace) -> KthenaConfig:
    if args.config:
        return load_config(args.config)
    nnodes = args.nnodes or 1
    world = nnodes * (args.nproc_per_node or 1)
    data: Mapping[str, object] = {
        "cluster": {"world_size": world, "nnodes": nnodes},
        "parallelism": {"tensor_parallel_size": args.tp or world // (args.pp or 1), "pipeline_parallel_size": args.pp or 1},
    }
    return load_config(data)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kthena-run", description="torchrun with Kthena's per-rank environment")
    p.add_argument("--config", help="kthena_config.yaml (cluster + parallelism sections)")
    p.add_argument("--nnodes", type=int)
    p.add_argument("--node_rank", type=int)
    p.add_argument("--nproc_per_node", type=int)
    p.add_argument("--master_addr")
    p.add_argument("--master_port", type=int)
    p.add_argument("--tp", type=int, help="tensor-parallel size without a config file")
    p.add_argument("--pp", type=int, help="pipeline-parallel size without a config file")
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    p.add_argument("--serving-group", action="store_true",
                   help="inside a Kthena serving group: master_addr, node_rank and nnodes from "
                        "ENTRY_ADDRESS, WORKER_INDEX and GROUP_SIZE (GROUP_SIZE must equal "
                        "--nnodes when given)")
    p.add_argument("--cpus", type=int,
                   help="cores the ranks of this node share, for OMP_NUM_THREADS (default: "
                        "this host's; a pod's CPU limit is not visible as a core count)")
    hccl = p.add_argument_group("HCCL (backend hccl; default: the same variables in the environment)")
    hccl.add_argument("--hccl-if-ip", help="HCCL_IF_IP: this node's address towards the others")
    hccl.add_argument("--hccl-socket-ifname", help="HCCL_SOCKET_IFNAME: NIC names, e.g. '=eth0'")
    hccl.add_argument("--hccl-connect-timeout", type=int,
                      help="HCCL_CONNECT_TIMEOUT seconds, 120..7200 (default 600)")
    hccl.add_argument("--rank-table-file", help="RANK_TABLE_FILE for rank-table launches")
    p.add_argument("--dry-run", action="store_true", help="print the environment and torchrun argv, run nothing")
    p.add_argument("script", help="the program every rank runs: a Python script, 'serve' for "
                                  "kthena serve (rank 0 serves, the others run its steps), or "
                                  "'pd-worker' for a PD worker (python -m kthena_serve.pd.worker)")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.serving_group:
            _take_serving_group(args, os.environ)
        if args.cpus is not None and args.cpus < 1:
            raise ConfigError(f"--cpus {args.cpus}: allowed: an integer >= 1")
        cfg = _config_from_args(args)
        run_argv = torchrun_argv(cfg, args)
    except ConfigError as e:
        print(f"kthena-run: error: {e}", file=sys.stderr)
        return 2
    backend = detect_backend() if args.backend == "auto" else args.backend
    nproc = int(run_argv[2].split("=")[1])
    try:
        hccl = _checked_hccl(args, cfg, backend, int(run_argv[0].split("=")[1]))
    except ConfigError as e:
        print(f"kthena-run: error: {e}", file=sys.stderr)
        return 2
    nnodes = int(run_argv[0].split("=")[1])
    gloo_ifname = None
    if backend == "gloo" and nnodes > 1 and "GLOO_SOCKET_IFNAME" not in os.environ:
        gloo_ifname = gloo_interface(run_argv[3].split("=", 1)[1])
    env = rank_environment(cfg, backend, nproc, num_cpus=args.cpus, hccl=hccl,
                           gloo_ifname=gloo_ifname)
    if args.dry_run:
        for k, v in sorted(env.items()):
            print(f"{k}={v}")
        print("torchrun " + " ".join(run_argv))
        return 0
    os.environ.update(env)
    try:
        from torch.distributed import run as torchrun
    except ImportError:
        print("kthena-run: error: torch is not installed (pip install 'kthena-core[launch]')", file=sys.stderr)
        return 2
    # torchrun keeps its per-rank log folders in one it makes under the temp folder
    # (torchelastic_*) and never removes; with its default redirects nothing that outlives the
    # run goes there (a failed rank's error is printed), so it gets one of ours, removed after.
    with tempfile.TemporaryDirectory(prefix="kthena-run-") as logs:
        torchrun.main([f"--log-dir={logs}", *run_argv])
    return 0


def _take_serving_group(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Fill master_addr / node_rank / nnodes from Kthena's serving-group variables."""
    if args.master_addr is not None or args.node_rank is not None:
        raise ConfigError("--serving-group takes the master address and node rank from "
                          "ENTRY_ADDRESS and WORKER_INDEX; drop --master_addr / --node_rank")
    group = ServingGroup.from_environ(environ, args.nnodes)
    args.master_addr, args.node_rank = group.entry_address, group.worker_index
    args.nnodes = group.group_size


def _checked_hccl(args: argparse.Namespace, cfg: KthenaConfig, backend: str,
                  nnodes: int) -> HcclSettings | None:
    if backend != "hccl":
        return None
    settings = hccl_settings(args, os.environ)
    check_hccl(settings, nnodes=nnodes, world_size=cfg.cluster.world_size)
    return settings


if __name__ == "__main__":
    sys.exit(main())
