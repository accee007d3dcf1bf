"""Shared pieces of discovery: the "not present" result, running a probe command, the
/proc/cpuinfo facts (CPU discovery's and the host probe's), and the device-relation matrix that
both ``nvidia-smi topo -m`` and ``npu-smi info -t topo`` print."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import attrs

from kthena_core.hardware import DeviceSpec
from kthena_core.topology import Link

__all__ = [
    "NotPresent",
    "ParseError",
    "Runner",
    "TopoMatrix",
    "parse_cpuinfo",
    "parse_cpulist",
    "pcie_link",
    "parse_topo_matrix",
    "run_command",
    "run_parsed",
]

_T = TypeVar("_T")

# A runner takes argv and returns stdout, or NotPresent when the command is missing or fails.
# Tests substitute one that replays recorded outputs.
Runner = Callable[[Sequence[str]], "str | NotPresent"]


class ParseError(ValueError):
    """A probe's output does not have the expected shape; the message says what was expected."""


@attrs.frozen
class NotPresent:
    """The result of probing for hardware that is not there (or could not be read).

    It is falsy, so ``if topo := discover_nvidia():`` works.

    Attributes:
        kind: "npu" | "gpu" | "cpu".
        reason: why, in words a user can act on ("npu-smi not found on PATH").
    """

    kind: str
    reason: str

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return f"{self.kind}: not present ({self.reason})"


def run_command(argv: Sequence[str], timeout: float = 15.0) -> str | NotPresent:
    """Run a probe command; return its stdout, or NotPresent naming what went wrong. Never raises."""
    exe = shutil.which(argv[0])
    if exe is None:
        return NotPresent("?", f"{argv[0]} not found on PATH")
    try:
        proc = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout,
                              check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return NotPresent("?", f"{' '.join(argv)} failed: {exc}")
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        return NotPresent("?", f"{' '.join(argv)} exited with {proc.returncode}: {tail[0]}")
    return proc.stdout


def run_parsed(runner: Runner, argv: Sequence[str], parse: Callable[[str], _T], kind: str,
               what: str) -> _T | NotPresent:
    """``parse`` of ``argv``'s output, or NotPresent(kind) saying why: the command is missing or
    failed, or its output (``what``) could not be read. Never raises."""
    out = runner(argv)
    if isinstance(out, NotPresent):
        return NotPresent(kind, out.reason)
    try:
        return parse(out)
    except ParseError as exc:
        return NotPresent(kind, f"could not read {what}: {exc}")


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-23,48-71' or '0,1' -> sorted CPU ids.

    Raises:
        ParseError: not a cpulist.
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ParseError(f"not a CPU list: {text!r} (expected e.g. '0-23,48-71')")
        lo, hi = int(m[1]), int(m[2] or m[1])
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


@attrs.frozen
class TopoMatrix:
    """The device x device relation table of ``nvidia-smi topo -m`` / ``npu-smi info -t topo``.

    Attributes:
        devices: row labels in order ("GPU0", "GPU1", ... or "NPU0", ...).
        relations: relations[i][j] is the cell for devices i, j ("X" on the diagonal, "NV18", "PIX",
            "HCCS", "SYS", ...).
        cpu_affinity: the "CPU Affinity" cell per device (e.g. "0-47,96-143"), or None.
        numa_affinity: the "NUMA Affinity" cell per device as an int, or None.
        nics: NIC column labels ("NIC0", ...); nic_relations[i][k] relates device i to NIC k.
        nic_names: "NIC0" -> "mlx5_0" from the NIC legend, when printed.
    """

    devices: tuple[str, ...]
    relations: tuple[tuple[str, ...], ...]
    cpu_affinity: tuple[str | None, ...]
    numa_affinity: tuple[int | None, ...]
    nics: tuple[str, ...] = ()
    nic_relations: tuple[tuple[str, ...], ...] = ()
    nic_names: Mapping[str, str] = attrs.field(factory=dict, eq=False, hash=False)

    def relation(self, i: int, j: int) -> str:
        return self.relations[i][j]

    def links(self, specs: Sequence[DeviceSpec],
              make: Callable[[str, int, int, DeviceSpec, DeviceSpec], Link | None],
              ) -> list[Link]:
        """The links between the first ``len(specs)`` devices, each pair once (a < b), that
        ``make(relation, a, b, spec_a, spec_b)`` turns their matrix relation into."""
        links = []
        for a in range(len(specs)):
            for b in range(a + 1, len(specs)):
                link = make(self.relation(a, b), a, b, specs[a], specs[b])
                if link is not None:
                    links.append(link)
        return links


def parse_topo_matrix(text: str, device_prefix: str) -> TopoMatrix:
    """Parse a relation matrix whose device rows and columns are ``<prefix><n>``.

    Tolerates tabs or spaces, a leading tab on the header, ' X ' cells, an empty column before
    'N/A', trailing spaces, and the Legend / NIC Legend sections (which are skipped, except that
    NIC names are collected).

    Raises:
        ParseError: no header line, or rows that do not match the header.
    """
    dev_re = re.compile(rf"^{device_prefix}\d+$")
    col_re = re.compile(rf"^(?:{device_prefix}|NIC)\d+$")
    header: list[str] | None = None
    rows: list[list[str]] = []
    nic_names: dict[str, str] = {}
    for line in text.splitlines():
        tokens = line.split()
        if not tokens:
            continue
        legend = re.fullmatch(r"(NIC\d+):\s*(\S+)", line.strip())
        if legend:
            nic_names[legend[1]] = legend[2]
            continue
        is_header = len(tokens) == 1 or col_re.match(tokens[1]) or tokens[1] == "CPU"
        if header is None and dev_re.match(tokens[0]) and is_header:
            header = [t for t in tokens if col_re.match(t)]
            continue
        if header is not None and dev_re.match(tokens[0]):
            rows.append(tokens)
    if header is None:
        raise ParseError(f"no header line with {device_prefix}0 {device_prefix}1 ... columns found")
    dev_cols = [c for c in header if dev_re.match(c)]
    nic_cols = [c for c in header if c.startswith("NIC")]
    if [r[0] for r in rows] != dev_cols:
        raise ParseError(f"row labels {[r[0] for r in rows]} do not match the header columns {dev_cols}")
    relations, nic_rel, cpu_aff, numa_aff = [], [], [], []
    ncols = len(header)
    for row in rows:
        cells = row[1:1 + ncols]
        if len(cells) < ncols:
            raise ParseError(f"row {row[0]} has {len(cells)} cells, expected {ncols}")
        by_col = dict(zip(header, cells, strict=True))
        relations.append(tuple(by_col[c] for c in dev_cols))
        nic_rel.append(tuple(by_col[c] for c in nic_cols))
        rest = row[1 + ncols:]
        cpu_aff.append(rest[0] if rest and rest[0] != "N/A" else None)
        numa_aff.append(int(rest[1]) if len(rest) > 1 and rest[1].isdigit() else None)
    for i, rel in enumerate(relations):
        if rel[i] != "X":
            raise ParseError(f"row {dev_cols[i]}: expected 'X' on the diagonal, got {rel[i]!r}")
    return TopoMatrix(devices=tuple(dev_cols), relations=tuple(relations),
                      cpu_affinity=tuple(cpu_aff), numa_affinity=tuple(numa_aff),
                      nics=tuple(nic_cols), nic_relations=tuple(nic_rel), nic_names=nic_names)


def numa_of_cpus(cpus: Sequence[int], numa_cpus: Mapping[int, Sequence[int]]) -> int | None:
    """The NUMA node holding most of ``cpus``, or None when unknown."""
    best, best_hits = None, 0
    wanted = set(cpus)
    for node, members in sorted(numa_cpus.items()):
        hits = len(wanted.intersection(members))
        if hits > best_hits:
            best, best_hits = node, hits
    return best


# PCIe-path relations shared by `nvidia-smi topo -m` and `npu-smi info -t topo`:
# relation -> (link kind, fraction of the slower device's pcie_bw, latency). The fractions are a
# ranking heuristic (same switch > across host bridges > across sockets), not measurements.
_PCIE_CLASS = {
    "PIX": ("pcie", 1.0, 5e-6),
    "PXB": ("pcie", 1.0, 6e-6),
    "PHB": ("pcie", 0.75, 8e-6),
    "NODE": ("pcie", 0.75, 8e-6),
    "SYS": ("sys", 0.5, 12e-6),
}


def pcie_link(rel: str, a: int, b: int, spec_a: DeviceSpec, spec_b: DeviceSpec) -> Link | None:
    """The Link a PCIe-path relation implies, or None when `rel` is not one."""
    if rel not in _PCIE_CLASS:
        return None
    kind, frac, lat = _PCIE_CLASS[rel]
    return Link(a, b, kind, frac * min(spec_a.pcie_bw, spec_b.pcie_bw), lat, via=rel)


def parse_cpuinfo(text: str) -> dict[str, object]:
    """The few /proc/cpuinfo facts discovery needs: model, vendor, flags, sockets, cores, MHz,
    and x86's family / model numbers (a VM's model name can be just "AMD EPYC")."""
    model = vendor = family = model_number = ""
    flags: set[str] = set()
    sockets: set[str] = set()
    cores: set[tuple[str, str]] = set()
    mhz: float | None = None
    physical = "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and not model:
            model = value
        elif key == "vendor_id" and not vendor:
            vendor = value
        elif key == "cpu family" and not family:
            family = value
        elif key == "model" and not model_number:
            model_number = value
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
        elif key == "physical id":
            physical = value
            sockets.add(value)
        elif key == "core id":
            cores.add((physical, value))
        elif key == "cpu MHz" and mhz is None:
            try:
                mhz = float(value)
            except ValueError:
                pass
    return {"model_name": model, "vendor": vendor, "family": family,
            "model_number": model_number, "flags": frozenset(flags),
            "num_sockets": len(sockets) or None, "num_physical_cores": len(cores) or None,
            "num_logical": text.count("\nprocessor") + text.startswith("processor"), "mhz": mhz}
