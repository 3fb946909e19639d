"""Lab 6 verdicts: right answers pass, plausible mistakes fail with a reason, stubs say TODO."""

import errno
import json
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from grader_harness import assert_passes, mistakes_fail, reference_passes, same_verdict_every_run, stubs_are_todo

from minioffload.course import check
from minioffload.course.check import lab06, lab06_commit, lab06_pipeline
from minioffload.pinned import ALIGNMENT, aligned_empty
from minioffload.predict import memory


def padded(nbytes):
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


# Task 6.1 --------------------------------------------------------------------------------------

def write_blocks(fd, data, block_size, *, pad=True, pad_byte=0, copy=False, one_call=False):
    """The reference answer, with switches that turn it into one plausible mistake at a time."""
    nbytes = len(data)
    step = max(nbytes, 1) if one_call else block_size
    for offset in range(0, nbytes, step):
        chunk = data[offset:offset + step]
        if pad and len(chunk) % ALIGNMENT:
            bounce = aligned_empty(padded(len(chunk)), pin=False).numpy()
            bounce[:] = pad_byte
            bounce[:len(chunk)] = np.frombuffer(chunk, np.uint8)
            chunk = memoryview(bounce)
        if copy:
            chunk = bytes(chunk)
        written = os.pwritev(fd, [chunk], offset)
        if written != len(chunk):
            raise OSError(errno.EIO, f"short write at offset {offset}")


def read_blocks(fd, into, nbytes, block_size, *, trim=True, skip_partial=False):
    for offset in range(0, nbytes, block_size):
        end = min(offset + block_size, nbytes)
        if (end - offset) % ALIGNMENT and trim:
            bounce = aligned_empty(padded(end - offset), pin=False).numpy()
            got = os.preadv(fd, [bounce], offset)
            into[offset:end] = memoryview(bounce)[:end - offset]
        elif (end - offset) % ALIGNMENT and skip_partial:
            continue
        else:
            got = os.preadv(fd, [into[offset:end]], offset)
        if got < end - offset:
            raise OSError(errno.EIO, f"short read at offset {offset}")


def block_io_with(write_mistake=None, read_mistake=None):
    def fn(write, fd, buffer, nbytes, block_size):
        if write:
            write_blocks(fd, buffer, block_size, **(write_mistake or {}))
        else:
            read_blocks(fd, buffer, nbytes, block_size, **(read_mistake or {}))
    return fn


def write_with_os_write(write, fd, buffer, nbytes, block_size):
    if write:
        os.write(fd, bytes(buffer) + bytes(padded(nbytes) - nbytes))
    else:
        read_blocks(fd, buffer, nbytes, block_size)


# Task 6.2 --------------------------------------------------------------------------------------

def fsync_folder(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(directory, key, write_version, index, *, same_slot=False, data_fsync="before", tmp_fsync=True,
           flush=True, replace=True, dir_fsync=True, mutate=False, keep_others=True, fsync_parent=False):
    """The reference answer, with switches that turn it into one plausible mistake at a time."""
    slot = index[key]["slot"] if key in index else 0
    if not same_slot:
        slot = 1 - index[key]["slot"] if key in index else 0
    fd = os.open(directory / f"{key}.{slot}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    entry = {"slot": slot, **write_version(fd)}
    if data_fsync == "before":
        os.fsync(fd)
    if mutate:
        index[key] = entry
    new_index = {**index, key: entry} if keep_others else {key: entry}
    target = directory / ("index.json.tmp" if replace else "index.json")
    with open(target, "w") as f:
        json.dump(new_index, f)
        if flush:
            f.flush()
        if tmp_fsync:
            os.fsync(f.fileno())
    if replace:
        os.replace(target, directory / "index.json")
    if dir_fsync:
        fsync_folder(directory.parent if fsync_parent else directory)
    if data_fsync == "after":
        os.fsync(fd)
    os.close(fd)
    return new_index


def commit_with(**mistake):
    def fn(directory, key, write_version, index):
        return commit(directory, key, write_version, index, **mistake)
    return fn


# Task 6.3 --------------------------------------------------------------------------------------

def pipelined_update(n, read, update, write, buffers):
    """The reference answer: subgroup k in buffer k % len(buffers)."""
    count = len(buffers)
    writes = [None] * count

    def start_read(k):
        b = k % count
        if writes[b] is not None:
            writes[b].result()  # never read into a buffer whose write is still in flight
        return buffers[b], read(k, buffers[b])

    reading = start_read(0) if n else None
    for k in range(n):
        buf, done = reading
        if k + 1 < n:
            reading = start_read(k + 1)
        done.result()
        update(k, buf)
        writes[k % count] = write(k, buf)
    for future in writes:
        if future is not None:
            future.result()


def pipelined_free_list(n, read, update, write, buffers):
    """Another right answer: a free list, and the oldest write waited for when none is free."""
    free, writing, reads = deque(buffers), deque(), {}

    def start_read(k):
        if not free:
            future, buf = writing.popleft()
            future.result()
            free.append(buf)
        buf = free.popleft()
        reads[k] = (read(k, buf), buf)

    for k in range(n):
        if k not in reads:
            start_read(k)
        if k + 1 < n:
            start_read(k + 1)
        future, buf = reads.pop(k)
        future.result()
        update(k, buf)
        writing.append((write(k, buf), buf))
    for future, _ in writing:
        future.result()


def serial(n, read, update, write, buffers):
    for k in range(n):
        read(k, buffers[0]).result()
        update(k, buffers[0])
        write(k, buffers[0]).result()


def waits_for_each_write(n, read, update, write, buffers):
    """Right on one drive: read(k + 1) is queued before update(k), and a write waited for at once costs no time,
    since the drive's one queue would run it before the next read anyway."""
    reading = read(0, buffers[0]) if n else None
    for k in range(n):
        done = reading
        if k + 1 < n:
            reading = read(k + 1, buffers[(k + 1) % 2])
        done.result()
        update(k, buffers[k % 2])
        write(k, buffers[k % 2]).result()


def waits_for_the_next_read(n, read, update, write, buffers):
    writes = [None] * len(buffers)
    following = read(0, buffers[0]) if n else None
    for k in range(n):
        b, current = k % len(buffers), following
        if k + 1 < n:
            c = (k + 1) % len(buffers)
            if writes[c] is not None:
                writes[c].result()
            following = read(k + 1, buffers[c])
            following.result()  # waits for the wrong read: k+1 is in before k is updated
        current.result()
        update(k, buffers[b])
        writes[b] = write(k, buffers[b])
    for future in writes:
        if future is not None:
            future.result()


def round_robin_without_waiting(n, read, update, write, buffers):
    writes = []
    reading = read(0, buffers[0]) if n else None
    for k in range(n):
        done = reading
        if k + 1 < n:
            reading = read(k + 1, buffers[(k + 1) % len(buffers)])
        done.result()
        update(k, buffers[k % len(buffers)])
        writes.append(write(k, buffers[k % len(buffers)]))
    for future in writes:
        future.result()


def reads_after_update(n, read, update, write, buffers):
    """Overlaps only the writes: the next read starts after the update, so the drive idles while the CPU works. On
    a drive with separate read and write queues this takes about n x (read + update); on one queue, the serial
    time."""
    writes = [None] * len(buffers)
    for k in range(n):
        b = k % len(buffers)
        if writes[b] is not None:
            writes[b].result()
        read(k, buffers[b]).result()
        update(k, buffers[b])
        writes[b] = write(k, buffers[b])
    for future in writes:
        if future is not None:
            future.result()


def no_wait_for_reads(n, read, update, write, buffers):
    for k in range(n):
        read(k, buffers[0])
        update(k, buffers[0])
        write(k, buffers[0]).result()


def no_final_wait(n, read, update, write, buffers):
    writes = [None] * len(buffers)
    for k in range(n):
        b = k % len(buffers)
        if writes[b] is not None:
            writes[b].result()
        read(k, buffers[b]).result()
        update(k, buffers[b])
        writes[b] = write(k, buffers[b])


def fresh_buffers(n, read, update, write, buffers):
    for k in range(n):
        buf = aligned_empty(4096, pin=False)
        read(k, buf).result()


# Task 6.4 --------------------------------------------------------------------------------------

def bytes_per_tier(num_params, precision="mixed_bf16", placement="optimizer_nvme"):
    """The reference answer to Task 6.4 (the grader holds none: it adds up the footprint's parts)."""
    fp = memory.footprint(precision, "adam", placement)
    return {tier: fp.bytes(num_params, tier) for tier in memory.TIERS}


# Task 6.5 --------------------------------------------------------------------------------------

def diagnose_with(*, always=None, per_file_ignored=False, profile_as_given=False, cpu_when_few_threads=False,
                  drives_anyway=False, subgroup_times=None, all_cores=False, extra_key=False):
    """A correct diagnosis, with switches that turn it into one plausible mistake at a time."""
    def measured(trace, lane, per_file):
        end = max(s.end for s in trace.spans)
        spans = [s for s in trace.on(lane) if s.nbytes and 0 < s.start < s.end < end]  # none cut by the step's ends
        return sum(s.nbytes for s in spans) / sum(s.duration - per_file for s in spans)

    def diagnose_drive(hw, run, predict):
        trace, settings, limits, work = run["trace"], run["settings"], run["limits"], run["work"]
        drives = settings["drives"]
        read = measured(trace, "nvme_read", 0 if per_file_ignored else hw.nvme_read_overhead)
        write = measured(trace, "nvme_write", 0 if per_file_ignored else hw.nvme_write_overhead)
        drive_s = sum(s.duration for lane in ("nvme_read", "nvme_write") for s in trace.on(lane))
        adam_s = sum(s.duration for s in trace.on("cpu") if s.name.startswith("adam"))
        if always:
            cause = always
        elif cpu_when_few_threads and settings["threads"] <= 2:
            cause = "cpu"
        elif read < 0.8 * drives * hw.nvme_read or write < 0.8 * drives * hw.nvme_write:
            cause = "drive"
        elif adam_s > drive_s:
            cause = "cpu"
        else:
            cause = "commits"
        if drives_anyway:
            return cause, {"drives": drives + 1}
        if subgroup_times:
            return cause, {"subgroup_numel": settings["subgroup_numel"] * subgroup_times}
        if all_cores and cause == "cpu":
            return cause, {"threads": hw.cores}
        believed = hw if profile_as_given else hw.replace(nvme_read=min(hw.nvme_read, read / drives),
                                                          nvme_write=min(hw.nvme_write, write / drives))
        size = settings["subgroup_numel"]
        sizes = [size * 2 ** k for k in range(40) if size * 2 ** k <= limits["max_subgroup_numel"]]
        for d in range(drives, limits["drives"] + 1):
            for t in range(settings["threads"], limits["threads"] + 1):
                for n in sizes:
                    tried = {"subgroup_numel": n, "drives": d, "threads": t}
                    if predict(believed, work, tried).step_s <= 0.97 * run["target_s"]:
                        fix = {k: v for k, v in tried.items() if v != settings[k]}
                        return cause, dict(fix, nvme_buffers=4) if extra_key else fix
        return cause, {}
    return diagnose_drive


REFERENCE = {
    "6.1": block_io_with(),
    "6.2": commit,
    "6.3": pipelined_update,
    "6.4": bytes_per_tier,
    "6.5": diagnose_with(),
}
WRONG = [  # (task, plausible mistake, what the verdict must mention)
    ("6.1", block_io_with(write_mistake={"pad": False}), "bounce buffer"),
    ("6.1", block_io_with(write_mistake={"pad_byte": 0xFF}), "padding after the data is not zeros"),
    ("6.1", block_io_with(write_mistake={"copy": True}), "not a multiple of 4096"),
    ("6.1", block_io_with(write_mistake={"one_call": True}), "one block per call"),
    ("6.1", write_with_os_write, "os.pwritev"),
    ("6.1", block_io_with(read_mistake={"trim": False}), "bounce buffer"),
    ("6.1", block_io_with(read_mistake={"trim": False, "skip_partial": True}), "the partial last block is read"),
    ("6.2", commit_with(same_slot=True), "the slot the index points to"),
    ("6.2", commit_with(data_fsync="after"), "fsync the new version's file"),
    ("6.2", commit_with(data_fsync="never"), "fsync the new version's file"),
    ("6.2", commit_with(tmp_fsync=False), "fsync the temporary index"),
    ("6.2", commit_with(flush=False), "flush the temporary index"),
    ("6.2", commit_with(replace=False), "os.replace it over index.json"),
    ("6.2", commit_with(dir_fsync=False), "fsync the folder after os.replace"),
    ("6.2", commit_with(fsync_parent=True), "fsync the folder after os.replace"),
    ("6.2", commit_with(mutate=True), "the index dict you were given changed"),
    ("6.2", commit_with(keep_others=False), "copies every other entry"),
    ("6.3", serial, "read(k + 1) only started after update(k)"),
    ("6.3", reads_after_update, "no pipeline beats n x (read + write)"),
    ("6.3", reads_after_update, "read(k + 1) only started after update(k)"),
    ("6.3", waits_for_the_next_read, "wait for read(k) alone"),
    ("6.3", round_robin_without_waiting, "while write("),
    ("6.3", no_wait_for_reads, "before read(0) had finished"),
    ("6.3", no_final_wait, "returned while write("),
    ("6.3", fresh_buffers, "not one of `buffers`"),
    ("6.4", lambda n, precision="mixed_bf16": memory.footprint(precision, "adam", "optimizer_nvme").by_tier(),
     "bytes per parameter"),
    ("6.4", lambda n, precision="mixed_bf16": bytes_per_tier(n, precision, "optimizer_cpu"), "ZeRO-Offload"),
    ("6.4", lambda n, precision="fp32": bytes_per_tier(n, precision), "default precision"),
    ("6.4", lambda n, precision="mixed_bf16": {"device": bytes_per_tier(n, precision)["device"]}, "three tiers"),
    ("6.5", diagnose_with(always="drive"), "moves bytes as fast as planned"),
    ("6.5", diagnose_with(always="cpu"), "the update waits for the drive"),
    ("6.5", diagnose_with(always="commits"), "fewer files would save at most that"),
    ("6.5", diagnose_with(per_file_ignored=True), "with each file's fixed cost taken off"),
    ("6.5", diagnose_with(cpu_when_few_threads=True), "the CPU (2 threads of 16) keeps up"),
    ("6.5", diagnose_with(profile_as_given=True), "not as the profile says"),
    ("6.5", diagnose_with(drives_anyway=True), "the machine has 1 drive(s) for the state"),
    ("6.5", diagnose_with(subgroup_times=64), "host memory holds the working sets"),
    ("6.5", diagnose_with(all_cores=True), "the job may use 12 cores"),
    ("6.5", diagnose_with(extra_key=True), "a fix may change only"),
]


test_reference_passes = reference_passes(REFERENCE)
test_plausible_mistake_fails_with_a_reason = mistakes_fail(WRONG)
test_stub_is_todo = stubs_are_todo(REFERENCE)
test_verdicts_hold_no_timings = same_verdict_every_run(REFERENCE, REFERENCE)


def test_another_pipeline_passes():
    assert_passes("6.3", pipelined_free_list)


def test_on_one_queue_waiting_for_each_write_costs_nothing():
    assert_passes("6.3", waits_for_each_write)


def test_the_fake_drive_has_one_queue_for_reads_and_writes():
    """A read and a write issued together finish one after the other: the drive's time is their sum."""
    name, n, read_s, update_s, write_s = lab06_pipeline.BALANCED
    buffers = [aligned_empty(lab06_pipeline.BUFFER_FLOATS * 4, pin=False).view(torch.float32) for _ in range(2)]
    with ThreadPoolExecutor(lab06_pipeline.DRIVE_WORKERS) as pool:
        drive = lab06_pipeline._FakeDrive(pool, buffers, 2, (read_s, 0.0, write_s))
        drive.read(0, buffers[0]).result()
        drive.update(0, buffers[0])
        started = time.perf_counter()
        writing, reading = drive.write(0, buffers[0]), drive.read(1, buffers[1])
        writing.result()
        reading.result()
        elapsed = time.perf_counter() - started
    assert elapsed >= read_s + write_s, f"a read and a write took {elapsed:.3f} s together, less than their sum"
    bounds = lab06_pipeline.time_bounds(n, read_s, update_s, write_s)
    assert bounds["drive"] < bounds["bound"] < bounds["serial"]


def test_without_o_direct_the_calls_are_still_checked(monkeypatch):
    """Where the filesystem refuses O_DIRECT, the logged calls still catch an unpadded last block."""
    monkeypatch.setattr(lab06, "_direct_works", lambda directory: False)
    assert check.grade("6.1", REFERENCE["6.1"]).passed
    verdict = check.grade("6.1", block_io_with(write_mistake={"pad": False}))
    assert verdict.status == "FAIL" and "bounce buffer" in verdict.detail, str(verdict)


def test_the_check_leaves_no_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for task_id in ("6.1", "6.2"):
        check.grade(task_id, REFERENCE[task_id])
        check.grade(task_id, WRONG[0][1] if task_id == "6.1" else commit_with(same_slot=True))
    assert list(tmp_path.iterdir()) == []


def test_the_model_drive_keeps_only_what_was_fsynced(tmp_path):
    (tmp_path / "old").write_bytes(b"a" * 100)
    disk = lab06_commit._Disk(tmp_path)
    (tmp_path / "old").write_bytes(b"b" * 100)  # written in place, not fsynced: torn
    (tmp_path / "new").write_bytes(b"c" * 10)  # a new name, the folder not fsynced: gone
    assert disk.after_crash() == {"old": b"b" * 50 + b"a" * 50}
    for name in ("old", "new"):
        fd = os.open(tmp_path / name, os.O_RDONLY)
        disk.fsync(fd)
        os.close(fd)
    assert disk.after_crash() == {"old": b"b" * 100}
    fd = os.open(tmp_path, os.O_RDONLY)
    disk.fsync(fd)
    os.close(fd)
    assert disk.after_crash() == {"old": b"b" * 100, "new": b"c" * 10}

