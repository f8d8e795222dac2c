"""What a worker tells the router about its hardware (WorkerInfo fields 30-33, issue 21 item 3).

Descriptions, not rates: the router learns each worker's speed from what it does
(services/router/worker_profile.py). These say which accelerator generation it
is (`accelerator_generation`: the CUDA device's name, or the CPU's vector
extension, "cpu-avx512" / "cpu-avx2" / "cpu"), how much memory is left beside
the model and its KV pool (`memory_headroom_bytes`: free device memory on CUDA,
MemAvailable on a CPU host) and, measured by the runtime, how long the model
took to load. Every read is best effort: what cannot be read is "" or 0
(unknown), never an error at registration.
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
MEMINFO = Path("/proc/meminfo")


def cpu_generation(cpuinfo: str) -> str:
    """The widest vector extension in /proc/cpuinfo's flags: the CPU regime's speed class."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            if "avx512f" in flags:
                return "cpu-avx512"
            if "avx2" in flags:
                return "cpu-avx2"
            return "cpu"
    return "cpu"


def mem_available_bytes(meminfo: str) -> int:
    """MemAvailable of /proc/meminfo in bytes (0 when absent)."""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024
    return 0


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def accelerator_generation(device: str) -> str:
    """The generation of the device an engine runs on ("" when unknown)."""
    if device.startswith("cuda"):
        try:
            import torch

            return torch.cuda.get_device_name(torch.device(device)).lower()
        except Exception:  # no driver, no device: unknown, not an error
            return ""
    if device.startswith("cpu"):
        return cpu_generation(_read(CPUINFO))
    return ""


def memory_headroom_bytes(device: str) -> int:
    """Memory left on the engine's device now (0 when unknown)."""
    if device.startswith("cuda"):
        try:
            import torch

            free, _ = torch.cuda.mem_get_info(torch.device(device))
            return int(free)
        except Exception:
            return 0
    if device.startswith("cpu"):
        return mem_available_bytes(_read(MEMINFO))
    return 0
