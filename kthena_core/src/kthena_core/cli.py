"""The ``kthena`` command: ``plan``, ``topo`` and ``deploy`` here; other layers add subcommands.

This module is the command-line shell of kthena_core: it is the one place in the layer that reads
argv. Installed layers register more subcommands (``serve``, ``bench`` ...) through the entry-point
group ``kthena.commands``; each entry point is a callable taking the argparse subparsers object.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from kthena_core.cache_dir import default_cache_dir, host_probe_file
from kthena_core.config_plan import resolve_topology
from kthena_core.known_models import load_model_spec


def _cmd_plan(args: argparse.Namespace) -> int:
    from kthena_core.planner import Planner
    from kthena_core.workload import Workload

    if args.calibrate and args.calibration:
        print("kthena plan: --calibrate fits a new calibration, --calibration uses one; give one "
              "of them", file=sys.stderr)
        return 2
    if args.config:
        return _cmd_plan_config(args)
    cache = default_cache_dir()
    model = load_model_spec(args.model)
    if (refusal := _unserved(args, model)) is not None:
        print(refusal, file=sys.stderr)
        return 2
    topology = resolve_topology(args.topology, cache_dir=cache, probe_file=host_probe_file())
    workload = Workload.parse(args.workload) if args.workload else Workload()
    overrides = {k: v for k, v in (("mode", args.mode), ("objective", args.objective)) if v}
    if overrides:
        workload = Workload(**{**workload.to_dict(), **overrides})
    fitted, used = _calibration(args, model, topology, cache, args.topology)
    factors = _factors(fitted, used, topology, args.topology)
    if args.sp_collective_factor is not None:
        if not args.sp_collective_factor > 0:
            print(f"kthena plan: --sp-collective-factor must be > 0 (1: a ring), got "
                  f"{args.sp_collective_factor}", file=sys.stderr)
            return 2
        import attrs

        factors = attrs.evolve(factors, params=attrs.evolve(
            factors.params, sp_collective_factor=args.sp_collective_factor))
    plan = Planner(factors.params, sequence_parallel=args.sp,
                   wide_ep=args.wide_ep).plan(model, topology, workload)
    _print_plan(args, plan, fitted, used, topology, factors)
    return 0


def _unserved(args: argparse.Namespace, model: Any) -> str | None:
    """Why ``kthena plan`` refuses `model` (an architecture the engine does not serve), or
    None; ``--any-architecture`` plans it anyway, for sizing hardware only."""
    from kthena_core.architectures import unserved_architecture

    why = unserved_architecture([model.architecture])
    if why is None or args.any_architecture:
        return None
    return (f"kthena plan: {model.name}: {why}. `kthena serve` would refuse it; plan it anyway "
            "to size hardware with --any-architecture")


def _factors(fitted: Any, used: Any, topology: Any, topology_spec: str) -> Any:
    """The factors the plan is scored with (``cpu_defaults.plan_factors``): the calibration
    file's, a fit that was not written, this CPU's class default, or the built-in ones."""
    from kthena_core.calibration_file import is_this_machine
    from kthena_core.cpu_defaults import PlanFactors, plan_factors

    if used is None and fitted is not None:
        return PlanFactors(fitted.params, "calibration fit (not written)")
    return plan_factors(used, topology, is_this_machine(topology_spec))


def _calibration(args: argparse.Namespace, model: Any, topology: Any, cache: Path,
                 topology_spec: str):
    """(the fit of --calibrate or None, the calibration the plan uses or None); a fit is
    written to --calibration-out, else to this machine's cache when planned on this machine."""
    from kthena_core.bench_record import cpu_text, load_bench, same_cpu
    from kthena_core.calibrate import fit_calibration
    from kthena_core.calibration_file import (
        cached_calibration_path,
        find_calibration,
        is_this_machine,
        load_calibration,
        planning_cpu,
        save_calibration,
    )

    here = planning_cpu(topology)
    if not args.calibrate:
        return None, find_calibration(args.calibration, cache, is_this_machine(topology_spec),
                                      cpu=here)
    fitted = fit_calibration(load_bench(args.calibrate), model, topology, source=args.calibrate)
    foreign = is_this_machine(topology_spec) and not same_cpu(fitted.cpu, here)
    if foreign:
        print(f"kthena plan: {args.calibrate} ran on {cpu_text(fitted.cpu)}, this machine is "
              f"{cpu_text(here)}: the factors were fitted to that CPU's own probe and are "
              "applied here to this machine's figures", file=sys.stderr)
    out = args.calibration_out or (cached_calibration_path(cache)
                                   if is_this_machine(topology_spec) and not foreign else None)
    if out is None:
        why = ("it is another CPU's" if foreign else
               "the topology is not this machine's (auto, auto:cores)")
        print(f"kthena plan: the calibration is not written: {why}; name a file with "
              "--calibration-out", file=sys.stderr)
        return fitted, None
    path = save_calibration(fitted, out)
    print(f"kthena plan: calibration written to {path}", file=sys.stderr)
    return fitted, load_calibration(path)


def _print_plan(args: argparse.Namespace, plan: Any, fitted: Any, used: Any,
                topology: Any, factors: Any) -> None:
    from kthena_core.calibrate import factors_dict
    from kthena_core.report import figures_dict, format_calibration, format_figures, format_plan

    if args.json:
        out = plan.to_dict(args.candidates)
        out["calibration"] = ({**fitted.to_dict(), "file": used.path if used else None}
                              if fitted else used.to_json() if used else None)
        out["cost_factors"] = factors_dict(factors.params)
        out["factors"] = factors.to_json()
        out["calibrated"] = bool(fitted) or factors.is_calibrated
        out["figures"] = figures_dict(topology)
        print(json.dumps(out))
        return
    print(format_plan(plan, args.candidates, None if fitted else factors.prediction_note()))
    print(format_figures(topology))
    print(f"factors   {factors.describe()}")
    if fitted:
        print(format_calibration(fitted))


def _cmd_plan_config(args: argparse.Namespace) -> int:
    """``kthena plan --config FILE``: the plan ``kthena serve --config FILE`` serves."""
    from kthena_core.config_plan import load_config_file, plan_config

    given = [f"--{n}" for n in ("model", "topology", "workload", "mode", "objective")
             if getattr(args, n) not in (None, "", "default", "auto")]
    if given:
        print(f"kthena plan: --config gives the model, topology and workload; drop "
              f"{', '.join(given)}", file=sys.stderr)
        return 2
    if args.sp or args.sp_collective_factor is not None or args.wide_ep:
        print("kthena plan: --config's parallelism.sequence_parallel_enabled decides whether SP "
              "is weighed, and a config weighs no wide EP (the engine runs none); drop --sp, "
              "--sp-collective-factor and --wide-ep", file=sys.stderr)
        return 2
    cache = default_cache_dir()
    cfg, topology = load_config_file(args.config, cache_dir=cache, probe_file=host_probe_file())
    model = load_model_spec(cfg.model.checkpoint_path)
    if (refusal := _unserved(args, model)) is not None:
        print(refusal, file=sys.stderr)
        return 2
    fitted, used = _calibration(args, model, topology, cache, cfg.cluster.topology)
    factors = _factors(fitted, used, topology, cfg.cluster.topology)
    _print_plan(args, plan_config(cfg, topology, model, factors.params), fitted, used,
                topology, factors)
    return 0


def _cmd_topo(args: argparse.Namespace) -> int:
    from kthena_core.discovery import describe, discover_all, measure_host

    if args.topology != "auto":
        topology = resolve_topology(args.topology, cache_dir=default_cache_dir(),
                                    probe_file=host_probe_file())
        print(json.dumps(topology.to_dict()) if args.json else describe(topology))
        return 0
    report = discover_all(host=measure_host(default_cache_dir(), probe_file=host_probe_file()))
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(report.describe())
    return 0


LAYERS = ("kthena-core", "kthena-comm", "mooncake-kv", "mooncake-ops", "kthena-serve")


def versions_line() -> str:
    """``kthena <version> (kthena-comm X, ...)``: each installed layer's version from its
    package metadata ("not installed" for a layer that is not)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in LAYERS:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    rest = ", ".join(f"{n} {v}" for n, v in found.items() if n != "kthena-core")
    return f"kthena {found['kthena-core']} ({rest})"


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an argument it does not know is its own error, printed with its
    usage (``usage: kthena serve ...``), not the top-level ``kthena`` usage argparse would print.
    Its subcommands' parsers are of this class too."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kthena", description="Kthena x Mooncake SDK command line")
    parser.add_argument("--version", action="version", version=versions_line())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    _add_plan_parser(sub)

    topo = sub.add_parser("topo", help="print what topology discovery sees")
    topo.add_argument("--topology", default="auto",
                      help="'auto', 'auto:cores', a YAML file or a catalog node name[:nodes]")
    topo.add_argument("--json", action="store_true")
    topo.set_defaults(func=_cmd_topo)

    from kthena_core.deploy.cli import add_deploy_parser

    add_deploy_parser(sub)

    for ep in entry_points(group="kthena.commands"):
        ep.load()(sub)
    return parser


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """``kthena plan`` and its flags."""
    plan = sub.add_parser("plan", help="choose TP x PP x SP x DP (x EP) for a model on a topology")
    plan.add_argument("--config", default=None, metavar="FILE.yaml",
                      help="plan a kthena_config.yaml exactly as `kthena serve --config` does "
                           "(its model, cluster.topology and service sizes)")
    plan.add_argument("--model", default="default",
                      help="'default' (SmolLM2-135M-Instruct), any name of a catalog model (its "
                           "catalog name, served name or Hub id: smollm2-135m-instruct, "
                           "SmolLM2-135M-Instruct, HuggingFaceTB/SmolLM2-135M-Instruct, "
                           "llama-3-8b ...), another Hub repo id ORG/NAME (its config.json), a "
                           "config.json, folder or .gguf")
    plan.add_argument("--topology", default="auto",
                      help="'auto' (discover this machine), 'auto:cores' (this host, one device "
                           "per core, as kthena serve pins ranks), a YAML file, or a catalog "
                           "node name[:nodes]")
    plan.add_argument("--workload", default="",
                      help="e.g. prompt_len=1024,output_len=256,concurrency=32,dtype=bf16,objective=latency")
    plan.add_argument("--mode", choices=("colocated", "pd"), help="override the workload's serving mode")
    plan.add_argument("--objective", choices=("throughput", "latency"), help="override the objective")
    plan.add_argument("--candidates", type=int, default=8, help="runner-up candidates to show")
    plan.add_argument("--calibrate", metavar="BENCH.json", default="",
                      help="fit the cost model's efficiencies to a `kthena bench serve` JSON of this model "
                           "on this machine (each within [0.05, 1.0] of the measured peak, or "
                           "refused), plan with them and write the calibration file "
                           "(--calibration-out, default this machine's cached one)")
    plan.add_argument("--calibration-out", metavar="FILE.json", default=None,
                      help="where --calibrate writes the calibration file")
    plan.add_argument("--calibration", metavar="FILE.json", default=None,
                      help="plan with this calibration file's factors ('none': the defaults; "
                           "default: this machine's cached calibration, when planning on this "
                           "machine)")
    plan.add_argument("--sp", action="store_true",
                      help="also weigh sequence parallelism (sp = tp over the TP group; the "
                           "engine runs it at pp = 1, colocated); default: every layout sp = 1")
    plan.add_argument("--sp-collective-factor", type=float, default=None, metavar="F",
                      help="SP's reduce-scatter + all-gather over the ring all-reduce's price "
                           "(default 1: a ring; `kthena bench layouts --sp-prompts` measures it "
                           "for gloo)")
    plan.add_argument("--wide-ep", action="store_true",
                      help="also weigh wide expert parallelism for a MoE model: ep of the dp "
                           "instances share one copy of the routed experts (colocated only). "
                           "The engine does not run it (its --enable-expert-parallel splits "
                           "the experts over one instance's TP ranks): kthena deploy k8s "
                           "refuses such a plan")
    plan.add_argument("--any-architecture", action="store_true",
                      help="plan a model whose architecture the engine does not serve (to size "
                           "hardware for it); default: refused, listing the served ones")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=_cmd_plan)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, KeyError, FileNotFoundError) as e:
        # Our errors subclass these builtins and carry a full message; no traceback for bad input.
        print(f"kthena {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `kthena plan | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
