"""Turn a ``kthena bench serve`` JSON of the default model into a CPU record for
``kthena_core/cpu_records/`` (the class defaults of ``kthena_core.cpu_defaults``).

    python scripts/cpu_record.py BENCH.json --name zen4 --isa-class x86-avx512-bf16 \\
        --source "what was run, where, when" > kthena_core/src/kthena_core/cpu_records/zen4.json

Keeps what a fit reads (the cases, the machine, the run's own probe) and drops the peers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from kthena_core.bench_record import bench_cpu, bench_probe
from kthena_core.cpu_defaults import fit_record, load_records

FITTED = ("compute_efficiency", "memory_efficiency", "step_overhead_s")

KEEP = ("bench", "model", "dtype", "quantization", "runs", "machine", "host_probe", "collectives")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench")
    parser.add_argument("--name", required=True)
    parser.add_argument("--isa-class", required=True)
    parser.add_argument("--source", required=True)
    args = parser.parse_args()
    with open(args.bench, encoding="utf-8") as f:
        bench = json.load(f)
    if bench_probe(bench) is None:
        print(f"{args.bench}: carries no probe of its run (host_probe or limits.machine)",
              file=sys.stderr)
        return 2
    cpu = bench_cpu(bench)
    record = {"record": {"name": args.name, "cpu": cpu, "isa_class": args.isa_class,
                         "source": args.source}}
    record |= {k: bench[k] for k in KEEP if k in bench}
    if "limits" in bench:
        record["limits"] = {"machine": bench["limits"]["machine"]}
    record["kthena"] = {case: v for case, v in bench["kthena"].items() if case != "c_speedup"}
    with tempfile.TemporaryDirectory() as folder:  # fit it where cpu_defaults reads records
        path = Path(folder) / f"{args.name}.json"
        path.write_text(json.dumps(record), encoding="utf-8")
        fitted = fit_record(load_records(Path(folder))[0])
    record["fit"] = {k: getattr(fitted, k) for k in FITTED}
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
