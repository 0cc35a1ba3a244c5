"""What this machine is: CPU model and instruction-set flags, cores, NUMA nodes, caches.

Read from Linux's /proc and /sys (no dependencies, nothing executed), so it is safe to call on any
machine; on other systems the fields it cannot read stay empty.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The instruction-set features the kernels care about, in the names /proc/cpuinfo uses.
ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512vbmi",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


@dataclass
class CPUInfo:
    model: str = ""
    arch: str = ""
    logical_cpus: int = 0
    usable_cpus: int = 0
    numa_nodes: int = 1
    flags: list[str] = field(default_factory=list)  # the ISA_FLAGS this CPU has
    caches: dict[str, str] = field(default_factory=dict)  # "L1d" -> "48K", ...

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def summary(self) -> str:
        isa = " ".join(self.flags) or "none of " + ",".join(ISA_FLAGS[:3])
        return f"{self.model or self.arch} | {self.usable_cpus} usable CPUs | {self.numa_nodes} NUMA node(s) | {isa}"


def cpu_info() -> CPUInfo:
    info = CPUInfo(arch=platform.machine(), logical_cpus=os.cpu_count() or 0)
    try:
        info.usable_cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        info.usable_cpus = info.logical_cpus
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not info.model:
                info.model = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    info.flags = [f for f in ISA_FLAGS if f in flags]
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    info.numa_nodes = max(1, len(nodes))
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index[0-9]*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        name = f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")
        info.caches[name] = size
    return info
