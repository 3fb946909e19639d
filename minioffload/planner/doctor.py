"""A pre-flight check of this machine for a plan: `python -m minioffload doctor --plan plan.json --nvme-dir DIR`.

    findings = diagnose(Plan.load("plan.json"), nvme_dir="/mnt/nvme/run1")
    print(report(findings))   # one row per check: ok | warn | fail | skip, what was found, what to change

Six checks, one function each: the locked-memory limit and the available host memory against the pinned bytes the
plan needs; the NVMe directory's free space, its bandwidth through the Swapper (hardware.disk_bandwidth) against the
plan's hardware profile, and O_DIRECT in it; the CUDA device against the plan's device bytes. Without a plan each
check reports what the machine has.

What this is not: a fixer. It changes nothing (the measurement writes into a temporary directory under DIR and
removes it; a missing DIR is not made), and it guarantees nothing: other processes may take memory or disk later.
"""

from __future__ import annotations

import argparse
import errno
import os
import resource
import shutil
import tempfile
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..units import GB, GiB, format_bytes
from .plan import Plan

STATUSES = ("ok", "warn", "fail", "skip")
MEASURE_BYTES = 64 << 20  # written and read back by the bandwidth check (about a second on an NVMe drive)
CAP_IPC_LOCK = 14  # linux/capability.h: lock memory past RLIMIT_MEMLOCK


@dataclass(frozen=True)
class Finding:
    check: str
    status: str  # "ok" | "warn" | "fail" | "skip"
    detail: str  # what was found, with its numbers
    fix: str = ""  # what to change ("" when ok)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Finding.status must be one of {', '.join(STATUSES)}, got {self.status!r}")


def _need(plan: Plan | None, tier: str) -> int:
    return int(plan.memory.get(tier) or 0) if plan else 0


def _uses_nvme(plan: Plan | None) -> bool:
    return plan is not None and "nvme" in (plan.optimizer_on, plan.params_on)


def _effective_caps() -> int | None:
    """This process's effective capability bits (/proc/self/status CapEff), or None where they cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return None


def _mem_available() -> int:
    """Bytes the kernel could hand out without swapping: MemAvailable, or free pages where /proc has no meminfo."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memlock(plan: Plan | None) -> Finding:
    """The soft RLIMIT_MEMLOCK against the plan's pinned bytes; a process with CAP_IPC_LOCK (root, outside a
    container) is not held to it. Neither is torch's pin_memory, which the runtime uses: the NVIDIA driver pins
    with its own allocator and does not count it against the limit; mlock and RDMA registration do. Hence warn,
    not fail: a low limit is a risk for what else pins memory in the run, not a sure failure of the runtime."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    name = "locked memory"
    shown = "unlimited" if soft == resource.RLIM_INFINITY else format_bytes(soft)
    caps = _effective_caps()
    exempt = bool(caps >> CAP_IPC_LOCK & 1) if caps is not None else os.geteuid() == 0
    if exempt:
        who = "root" if os.geteuid() == 0 else "this user"
        return Finding(name, "ok", f"ulimit -l {shown}, but {who} holds CAP_IPC_LOCK: the limit does not apply")
    need = _need(plan, "host")
    root = " (root without CAP_IPC_LOCK, as in a container by default: the limit applies)" if os.geteuid() == 0 else ""
    if soft == resource.RLIM_INFINITY or not plan or need <= soft:
        pins = f"; the plan pins {format_bytes(need)}" if plan else ""
        return Finding(name, "ok", f"ulimit -l {shown}{root}{pins}")
    return Finding(name, "warn", f"ulimit -l {shown}{root} is below the {format_bytes(need)} of pinned host memory the "
                   "plan needs; torch's pinned allocator is not held to it, but mlock and RDMA registration are",
                   "`ulimit -l unlimited` in the shell that trains" + ("" if hard == resource.RLIM_INFINITY else
                   f" (the hard limit, {format_bytes(hard)}, caps it)") + "; for good, `* soft memlock unlimited` and "
                   "`* hard memlock unlimited` in /etc/security/limits.conf, then log in again; in docker, "
                   "`--ulimit memlock=-1`")


def check_host_memory(plan: Plan | None, cuda: bool) -> Finding:
    """MemAvailable against the plan's pinned host bytes (and, on the sim, its device bytes: they live in host
    memory there)."""
    available, name = _mem_available(), "host memory"
    if plan is None:
        return Finding(name, "ok", f"{format_bytes(available)} available")
    need = _need(plan, "host") + (0 if cuda else _need(plan, "device"))
    what = f"the plan needs {format_bytes(need)}" + ("" if cuda else " (pinned host + the sim device's memory)")
    detail = f"{format_bytes(available)} available, {what}"
    if need > available:
        return Finding(name, "fail", detail, "stop what else holds memory, or plan again for less host memory "
                                             "(the optimizer or the weights on NVMe)")
    if need > 0.9 * available:
        return Finding(name, "warn", detail + ": less than 10% left for the rest of the process",
                       "stop what else holds memory, or expect swapping")
    return Finding(name, "ok", detail)


def check_nvme_space(plan: Plan | None, nvme_dir: str | None) -> Finding:
    from ..paths import usable_directory

    need, name = _need(plan, "nvme"), "nvme space"
    if nvme_dir is None:
        if _uses_nvme(plan):
            return Finding(name, "fail", f"the plan keeps {format_bytes(need)} on NVMe and no --nvme-dir was given",
                           "give --nvme-dir DIR on the drive")
        return Finding(name, "skip", "no --nvme-dir" + (": the plan keeps nothing on NVMe" if plan else ""))
    try:
        usable_directory(nvme_dir, "--nvme-dir")
    except ValueError as err:
        return Finding(name, "fail", str(err), "give --nvme-dir a directory this user can write, on the NVMe drive")
    free = shutil.disk_usage(_existing(nvme_dir)).free
    detail = f"{format_bytes(free)} free under {nvme_dir}" + (f", the plan keeps {format_bytes(need)}" if plan else "")
    if need > free:
        return Finding(name, "fail", detail, "free space on that drive, or choose a directory on a larger one")
    return Finding(name, "ok", detail)


def _existing(path: str) -> Path | None:
    """`path`, or its nearest existing parent (the run makes a missing --nvme-dir there); None for a file."""
    if Path(path).exists() and not Path(path).is_dir():
        return None
    return next(p for p in (Path(path), *Path(path).parents) if p.is_dir())


def check_nvme_bandwidth(plan: Plan | None, nvme_dir: str | None, measure: bool) -> Finding:
    from ..machine import measure as hardware
    from ..machine import profiles

    name = "nvme bandwidth"
    if nvme_dir is None or _existing(nvme_dir) is None:
        return Finding(name, "skip", "no --nvme-dir" if nvme_dir is None else f"{nvme_dir} is not a directory")
    if not measure:
        return Finding(name, "skip", "not measured (--no-measure)")
    try:
        with tempfile.TemporaryDirectory(dir=_existing(nvme_dir), prefix=".doctor-") as scratch, \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # O_DIRECT refused: the O_DIRECT check reports it
            rate = hardware.disk_bandwidth(scratch, MEASURE_BYTES)
    except OSError as err:
        return Finding(name, "fail", f"could not write and read {nvme_dir}: {err}", "check the drive and its space")
    detail = f"read {rate['read'] / GB:.2f} GB/s, write {rate['write'] / GB:.2f} GB/s (Swapper, " \
             f"{format_bytes(MEASURE_BYTES)})"
    if plan is None:
        return Finding(name, "ok", detail)
    try:
        assumed = profiles.preset(plan.hardware)
    except ValueError:
        return Finding(name, "ok", f"{detail}; the plan's profile {plan.hardware!r} is not a preset: nothing to "
                                   "compare with")
    detail += (f"; the plan assumed {assumed.nvme_read / GB:.2f} and {assumed.nvme_write / GB:.2f} GB/s "
               f"({plan.hardware})")
    slow = rate["read"] < assumed.nvme_read / 2 or rate["write"] < assumed.nvme_write / 2
    if slow and _uses_nvme(plan):
        return Finding(name, "warn", detail + ": below half", "plan again on this machine's measured profile "
                       f"(profiles.probe(nvme_dir={nvme_dir!r})), or put --nvme-dir on a faster drive")
    return Finding(name, "ok", detail + ("" if _uses_nvme(plan) else "; the plan keeps nothing on NVMe"))


def check_o_direct(nvme_dir: str | None) -> Finding:
    from ..pinned import ALIGNMENT, aligned_empty

    name = "o_direct"
    if nvme_dir is None or _existing(nvme_dir) is None:
        return Finding(name, "skip", "no --nvme-dir" if nvme_dir is None else f"{nvme_dir} is not a directory")
    buffered = ("the Swapper falls back to buffered I/O and warns: swapped state goes through the page cache, "
                "which competes with pinned memory, and rates measured there are the cache's, not the drive's")
    fix = "put --nvme-dir on a filesystem on the NVMe drive (ext4, xfs), not tmpfs"
    if not hasattr(os, "O_DIRECT"):
        return Finding(name, "warn", f"this platform has no O_DIRECT: {buffered}", fix)
    where = _existing(nvme_dir)
    try:
        fd, probe = tempfile.mkstemp(dir=where, prefix=".doctor-odirect-")
    except OSError as err:
        return Finding(name, "fail", f"cannot create a file in {where}: {err.strerror}", "choose a writable directory")
    os.close(fd)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_DIRECT)
        try:
            os.pwritev(fd, [memoryview(aligned_empty(ALIGNMENT, pin=False).numpy())], 0)
        finally:
            os.close(fd)
    except OSError as err:
        why = "refused" if err.errno == errno.EINVAL else f"failed ({err.strerror})"
        return Finding(name, "warn", f"O_DIRECT {why} in {where}: {buffered}", fix)
    finally:
        os.unlink(probe)
    return Finding(name, "ok", f"an aligned O_DIRECT write works in {where}")


def check_cuda(plan: Plan | None) -> tuple[Finding, bool]:
    """The CUDA device the runtime uses (cuda:0 of those visible) against the plan's device bytes."""
    import torch

    name, need = "cuda", _need(plan, "device")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
    if not torch.cuda.is_available():
        from ..devices.sim import SimDevice

        why = "this torch is a CPU build" if torch.version.cuda is None else "torch sees no GPU" + shown
        sim = SimDevice.DEFAULT_MEMORY
        size = "" if not plan else f"; the plan needs {format_bytes(need)} of its memory" + (
            f": give --device-memory {-(-need // GiB)}GiB (default {format_bytes(sim)})" if need > sim else "")
        return Finding(name, "warn", f"no CUDA device: runs use the simulated device ({why}){size}",
                       "to train on a GPU: a CUDA build of torch and a GPU that nvidia-smi lists"), False
    try:
        free, total = torch.cuda.mem_get_info(0)
        label = f"{torch.cuda.device_count()} visible{shown}, cuda:0 {torch.cuda.get_device_name(0)}"
    except RuntimeError as err:
        return Finding(name, "fail", f"torch sees a GPU but cannot use it: {err}", "check the driver: nvidia-smi"), True
    detail = f"{label}: {format_bytes(free)} free of {format_bytes(total)}" + (
        f", the plan needs {format_bytes(need)}" if plan else "")
    if need > total:
        return Finding(name, "fail", detail, "plan again for this GPU's memory"), True
    if need > free:
        return Finding(name, "warn", detail + ": other processes hold the rest", "stop them (nvidia-smi)"), True
    return Finding(name, "ok", detail), True


def diagnose(plan: Plan | None = None, nvme_dir: str | None = None, measure: bool = True) -> list[Finding]:
    """Every check's finding. `measure=False` skips the bandwidth measurement (the one check that takes time)."""
    cuda, has_cuda = check_cuda(plan)
    return [check_memlock(plan), check_host_memory(plan, has_cuda), check_nvme_space(plan, nvme_dir),
            check_nvme_bandwidth(plan, nvme_dir, measure), check_o_direct(nvme_dir), cuda]


def report(findings: list[Finding], width: int = 110) -> str:
    """A table: check, status, what was found, and under it what to change."""
    indent = " " * 24
    lines = [f"{'check':<16}{'status':<8}what was found / fix"]
    for f in findings:
        lines.append(textwrap.fill(f.detail, width, initial_indent=f"{f.check:<16}{f.status:<8}",
                                   subsequent_indent=indent))
        if f.fix:
            lines.append(textwrap.fill("fix: " + f.fix, width, initial_indent=indent,
                                       subsequent_indent=indent + "     "))
    counts = {s: sum(f.status == s for f in findings) for s in STATUSES}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return "\n".join(lines)


def doctor_command(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan) if args.plan else None  # ValueError naming the file and the fix
    if plan:
        print(f"plan {args.plan}: {plan.model} on {plan.hardware}; needs {plan.memory_line()}\n")
    findings = diagnose(plan, args.nvme_dir, measure=args.measure)
    print(report(findings))
    return 1 if any(f.status == "fail" for f in findings) else 0


def add_doctor_parser(commands) -> argparse.ArgumentParser:
    dr = commands.add_parser("doctor", help="check this machine for a plan (changes nothing)")
    dr.add_argument("--plan", default=None, metavar="FILE", help="a plan written by `python -m minioffload plan`")
    dr.add_argument("--nvme-dir", default=None, metavar="DIR", help="the directory the run will swap to")
    dr.add_argument("--no-measure", dest="measure", action="store_false",
                    help=f"skip the NVMe bandwidth measurement (it writes and reads {format_bytes(MEASURE_BYTES)})")
    dr.set_defaults(run=doctor_command)
    return dr
