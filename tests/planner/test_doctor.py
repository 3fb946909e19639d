"""`python -m minioffload doctor`: each check against a machine made to fail it, the report, and the command."""

import argparse
import dataclasses
import errno
import os
import resource
import shutil
from collections import namedtuple

import pytest
import torch

from minioffload.machine import measure as hardware
from minioffload.planner import doctor
from minioffload.planner.doctor import Finding, add_doctor_parser, diagnose, report
from minioffload.planner.plan import ModelSpec, Plan
from minioffload.units import GiB, MiB

SPEC = ModelSpec.of_preset("tiny")


def make_plan(**changes) -> Plan:
    plan = Plan(model=SPEC, hardware="h100-sxm", precision="fp32", micro_batch=2, grad_accum=1, optimizer_on="host",
                params_on="device", activations=("keep",) * SPEC.n_layer, step_s=0.1,
                memory={"device": 1 << 20, "host": 1 << 20, "nvme": 0})
    return dataclasses.replace(plan, **changes)


NVME_PLAN = make_plan(optimizer_on="nvme", memory={"device": 1 << 20, "host": 1 << 20, "nvme": 10 * GiB})


def one(findings, check) -> Finding:
    (found,) = [f for f in findings if f.check == check]
    return found


@pytest.fixture
def non_root(monkeypatch):
    """An ordinary user: not root, no capabilities, an 8 MiB locked-memory limit (a common default)."""
    monkeypatch.setattr(resource, "getrlimit", lambda which: (8 * MiB, 8 * MiB))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(doctor, "_effective_caps", lambda: 0)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_memlock_below_the_pinned_bytes_warns_and_names_the_fix(non_root):
    found = doctor.check_memlock(make_plan(memory={"device": 0, "host": 2 * GiB, "nvme": 0}))
    assert found.status == "warn"
    assert "8.00 MiB" in found.detail and "2.00 GiB" in found.detail
    assert "ulimit -l unlimited" in found.fix and "/etc/security/limits.conf" in found.fix
    assert "--ulimit memlock=-1" in found.fix and "hard limit, 8.00 MiB" in found.fix
    assert doctor.check_memlock(make_plan()).status == "ok"  # 1 MiB fits under 8 MiB
    assert doctor.check_memlock(None).status == "ok"  # no plan: what the machine has


def test_memlock_with_cap_ipc_lock_does_not_apply(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (64 * 1024, 64 * 1024))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(doctor, "_effective_caps", lambda: 1 << doctor.CAP_IPC_LOCK)
    found = doctor.check_memlock(make_plan(memory={"device": 0, "host": 2 * GiB, "nvme": 0}))
    assert found.status == "ok" and "root holds CAP_IPC_LOCK" in found.detail and found.fix == ""
    monkeypatch.setattr(doctor, "_effective_caps", lambda: 0)  # root in a container: no CAP_IPC_LOCK
    found = doctor.check_memlock(make_plan(memory={"device": 0, "host": 2 * GiB, "nvme": 0}))
    assert found.status == "warn" and "container" in found.detail


def test_memlock_unlimited_is_ok(non_root, monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    found = doctor.check_memlock(make_plan(memory={"device": 0, "host": 100 * GiB, "nvme": 0}))
    assert found.status == "ok" and "unlimited" in found.detail


def test_effective_caps_reads_this_process():
    caps = doctor._effective_caps()
    assert caps is None or caps >= 0


def test_too_little_available_memory_fails(monkeypatch):
    monkeypatch.setattr(doctor, "_mem_available", lambda: 3 * MiB // 2)
    plan = make_plan()  # 1 MiB pinned, 1 MiB on the device
    assert doctor.check_host_memory(plan, cuda=True).status == "ok"
    found = doctor.check_host_memory(plan, cuda=False)  # on the sim, device memory is host memory too
    assert found.status == "fail" and "2.00 MiB" in found.detail and "1.50 MiB available" in found.detail
    assert "plan again" in found.fix
    assert doctor.check_host_memory(None, cuda=False).status == "ok"


def test_mem_available_is_this_machines():
    assert 0 < doctor._mem_available() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_nvme_plan_without_a_directory_fails():
    findings = diagnose(NVME_PLAN, None, measure=False)
    found = one(findings, "nvme space")
    assert found.status == "fail" and "10.00 GiB on NVMe" in found.detail
    assert found.fix == "give --nvme-dir DIR on the drive"
    assert one(findings, "nvme bandwidth").status == "skip" and one(findings, "o_direct").status == "skip"
    assert one(diagnose(make_plan(), None, measure=False), "nvme space").status == "skip"  # nothing on NVMe


def test_nvme_directory_with_too_little_space_fails(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * GiB, 99 * GiB, GiB))
    found = doctor.check_nvme_space(NVME_PLAN, str(tmp_path))
    assert found.status == "fail" and "1.00 GiB free" in found.detail and "10.00 GiB" in found.detail
    assert "larger" in found.fix
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * GiB, 0, 100 * GiB))
    assert doctor.check_nvme_space(NVME_PLAN, str(tmp_path / "not-yet")).status == "ok"  # the run makes it


def test_nvme_directory_that_is_a_file_fails(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("x")
    findings = diagnose(NVME_PLAN, str(path), measure=True)
    assert one(findings, "nvme space").status == "fail" and "is a file" in one(findings, "nvme space").detail
    assert one(findings, "nvme bandwidth").status == "skip" and one(findings, "o_direct").status == "skip"


def test_o_direct_refused_warns_and_says_what_the_swapper_does(tmp_path, monkeypatch):
    assert doctor.check_o_direct(str(tmp_path)).status in ("ok", "warn")  # whatever this file system does
    real_open = os.open

    def refuse_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_direct)
    found = doctor.check_o_direct(str(tmp_path))
    assert found.status == "warn" and "O_DIRECT refused" in found.detail and "buffered I/O" in found.detail
    assert "tmpfs" in found.fix
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_bandwidth_is_measured_and_compared_with_the_profile(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "MEASURE_BYTES", 1 * MiB)
    found = doctor.check_nvme_bandwidth(NVME_PLAN, str(tmp_path), measure=True)  # a real, small measurement
    assert found.status in ("ok", "warn") and "GB/s" in found.detail and "h100-sxm" in found.detail
    assert list(tmp_path.iterdir()) == []  # the scratch directory is gone
    monkeypatch.setattr(hardware, "disk_bandwidth", lambda directory, nbytes: {"read": 1e9, "write": 3e9})
    found = doctor.check_nvme_bandwidth(NVME_PLAN, str(tmp_path), measure=True)
    assert found.status == "warn" and "read 1.00 GB/s" in found.detail and "7.00" in found.detail
    monkeypatch.setattr(hardware, "disk_bandwidth", lambda directory, nbytes: {"read": 6e9, "write": 3e9})
    assert doctor.check_nvme_bandwidth(NVME_PLAN, str(tmp_path), measure=True).status == "ok"
    probed = dataclasses.replace(NVME_PLAN, hardware="this machine (sim)")
    found = doctor.check_nvme_bandwidth(probed, str(tmp_path), measure=True)
    assert found.status == "ok" and "not a preset" in found.detail
    assert doctor.check_nvme_bandwidth(NVME_PLAN, str(tmp_path), measure=False).status == "skip"


def test_without_cuda_the_sim_is_used(no_cuda):
    found, has_cuda = doctor.check_cuda(make_plan(memory={"device": 5 * GiB, "host": 0, "nvme": 0}))
    assert not has_cuda and found.status == "warn"
    assert found.detail.startswith("no CUDA device: runs use the simulated device")
    assert "--device-memory 5GiB" in found.detail


def test_a_gpu_too_small_for_the_plan_fails(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (2 * GiB, 8 * GiB))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Fake GPU")
    found, has_cuda = doctor.check_cuda(make_plan(memory={"device": 16 * GiB, "host": 0, "nvme": 0}))
    assert has_cuda and found.status == "fail" and "Fake GPU" in found.detail and "8.00 GiB" in found.detail
    found, _ = doctor.check_cuda(make_plan(memory={"device": 4 * GiB, "host": 0, "nvme": 0}))
    assert found.status == "warn" and "other processes" in found.detail
    assert doctor.check_cuda(make_plan())[0].status == "ok"


def test_without_a_plan_nothing_fails(tmp_path, no_cuda):
    findings = diagnose(None, str(tmp_path), measure=False)
    assert [f.check for f in findings] == ["locked memory", "host memory", "nvme space", "nvme bandwidth",
                                           "o_direct", "cuda"]
    assert all(f.status != "fail" for f in findings)
    assert all(f.fix == "" for f in findings if f.status == "ok")


def test_report_is_a_table_with_fixes():
    findings = [Finding("host memory", "ok", "22 GiB available"),
                Finding("nvme space", "fail", "no --nvme-dir", "give --nvme-dir DIR on the drive")]
    text = report(findings)
    lines = text.splitlines()
    assert lines[0].split() == ["check", "status", "what", "was", "found", "/", "fix"]
    assert lines[1].split()[:3] == ["host", "memory", "ok"]
    assert lines[3].strip() == "fix: give --nvme-dir DIR on the drive"
    assert lines[-1] == "1 ok, 1 fail"
    with pytest.raises(ValueError, match="status must be one of"):
        Finding("x", "bad", "y")


def run_cli(argv) -> int:
    parser = argparse.ArgumentParser()
    add_doctor_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["doctor", *argv])
    return args.run(args)


def test_cli_with_a_saved_plan(tmp_path, capsys, non_root, no_cuda):
    path = make_plan().save(tmp_path / "plan.json")
    assert run_cli(["--plan", str(path), "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert f"plan {path}: GPT 'tiny'" in out
    for check in ("locked memory", "host memory", "nvme space", "nvme bandwidth", "o_direct", "cuda"):
        assert check in out
    assert "no CUDA device: runs use the simulated device" in out
    path = NVME_PLAN.save(tmp_path / "nvme.json")
    assert run_cli(["--plan", str(path), "--no-measure"]) == 1
    assert "fix: give --nvme-dir DIR on the drive" in capsys.readouterr().out
    assert run_cli(["--plan", str(path), "--no-measure", "--nvme-dir", str(tmp_path / "swap")]) == 0
    out = capsys.readouterr().out
    assert "not measured (--no-measure)" in out and "free under" in out


def test_cli_missing_or_bad_plan_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no plan at .*missing.json: write one with `python -m minioffload plan"):
        run_cli(["--plan", str(tmp_path / "missing.json")])
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a minioffload plan"):
        run_cli(["--plan", str(tmp_path / "bad.json")])
