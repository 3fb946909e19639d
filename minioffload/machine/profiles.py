"""The hardware table: ONE place for every hardware figure the course quotes, each with its source.

    hw = profiles.preset("h100-sxm")        # a cited profile of one GPU and the host share it has
    hw.link_h2d / 1e9                       # achieved pinned host-to-device GB/s
    hw.cite("link_h2d")                     # where that figure comes from
    here = profiles.probe()                 # this machine: the simulated device plus measured host figures
    profiles.preset("v100-dgx2")            # also the machines of published setups (PAPER_PRESETS)
    profiles.preset("4xgh200").interconnect  # and whole nodes (NODE_PRESETS): B/s between GPUs, per GPU

A `Hardware` profile describes ONE device and the part of a host it can count on: in an 8-GPU server,
one GPU, its own PCIe link, an eighth of the host's memory and an even share of its cores, memory
bandwidth and drives. Units are SI: bytes, bytes/s (1 GB/s = 1e9 B/s), FLOP/s, params/s, seconds.
Memory sizes are bytes as the vendor sells them (decimal GB for GPUs, binary GiB for DIMMs).

Link figures come in two kinds: `link_theoretical` is the signalling rate of the slot (PCIe Gen4 x16:
16 GT/s x 16 lanes x 128/130 / 8 = 31.5 GB/s per direction); `link_h2d`/`link_d2h` are what a pinned copy
achieves, which is the figure a model of the step must use.

`interconnect` is what a ring collective between GPUs achieves per GPU, as NCCL's tests report it ("busbw": for
an all-reduce of S bytes taking t, 2 (N - 1) / N x S / t): the bytes one rank sends (shards.ring_bytes) over it
give a collective's time. `gpus_per_node` GPUs reach each other at that rate (NVLink, PCIe); the node presets
(NODE_PRESETS) name whole nodes, and "gh200-ib" superchips one per node on InfiniBand.

Figures marked "estimate" in their source were not measured by us or stated by a vendor in that form:
they are derived (a fraction of a theoretical peak, or per-GPU shares of a server) and say how.

What this is not: a measurement tool (machine/measure.py measures this machine; `probe()` collects its results
into a profile), nor a model of the step (predict/stepmodel.py uses these figures).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from ..units import GB, GiB

# Figures every profile has, with their units (for messages and tables).
FIGURES = {
    "device_memory": "B", "device_bandwidth": "B/s", "peak_flops_bf16": "FLOP/s", "peak_flops_fp32": "FLOP/s",
    "device_adam_rate": "params/s", "link_theoretical": "B/s", "link_h2d": "B/s", "link_d2h": "B/s",
    "link_latency": "s", "copy_overhead": "s", "grad_hook_overhead": "s", "subgroup_overhead": "s",
    "fetch_overhead": "s", "pack_overhead": "s",
    "host_memory": "B",
    "host_bandwidth": "B/s", "cpu_adam_rate": "params/s",
    "nvme_read": "B/s", "nvme_write": "B/s", "nvme_read_overhead": "s", "nvme_write_overhead": "s", "cores": "",
    "interconnect": "B/s", "collective_latency": "s", "gpus_per_node": "",
}

ADAM_BYTES_PER_PARAM = 28  # fp32 AdamW: reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq


@dataclass(frozen=True)
class Hardware:
    """One device and its share of a host. Every figure is positive; `sources` cites each one."""

    name: str
    description: str
    device_memory: float  # B
    device_bandwidth: float  # B/s, the device's own memory (HBM)
    peak_flops_bf16: float  # FLOP/s, dense tensor-core bf16 (fp32 accumulate)
    peak_flops_fp32: float  # FLOP/s, dense fp32 (no TF32)
    device_adam_rate: float  # params/s, a fused fp32 AdamW on the device
    link_theoretical: float  # B/s per direction, the slot's signalling rate
    link_h2d: float  # B/s, achieved pinned host->device
    link_d2h: float  # B/s, achieved pinned device->host
    link_latency: float  # s, the fixed cost of one copy on the link
    copy_overhead: float  # s, host time to issue one copy (the launch: a driver call, or the sim's queueing)
    grad_hook_overhead: float  # s, host time per gradient in the offload engine's hook beyond its copy's issue
    subgroup_overhead: float  # s, host time per subgroup in the offload engine's step beyond its bytes and upload issue
    fetch_overhead: float  # s, host time per streamed block fetched and released, beyond its copy (chapter 8's hooks)
    pack_overhead: float  # s, host time per saved tensor offloaded and brought back (chapter 7's hooks and copies)
    host_memory: float  # B
    host_bandwidth: float  # B/s, achieved with Adam's access pattern (4 reads, 3 writes), all cores
    cpu_adam_rate: float  # params/s, a fused fp32 CPU AdamW on all cores
    nvme_read: float  # B/s
    nvme_write: float  # B/s
    nvme_read_overhead: float  # s per file read beyond its bytes (open, bookkeeping)
    nvme_write_overhead: float  # s per file write beyond its bytes (the durable commit: fsyncs, the index renamed)
    cores: int
    interconnect: float  # B/s per GPU: the bus bandwidth a ring collective achieves between GPUs (NCCL's busbw)
    collective_latency: float  # s, the fixed cost of one collective, whatever its size
    gpus_per_node: int  # GPUs that share the host and reach each other at `interconnect`
    shared_host: bool = False  # the "device" computes on the host's cores and DRAM (the simulated device)
    sources: dict = field(default_factory=dict, compare=False)  # figure -> where it comes from

    def __post_init__(self) -> None:
        for name in FIGURES:
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not (value > 0 and math.isfinite(value)):
                raise ValueError(f"hardware profile {self.name!r}: {name} must be a positive finite number "
                                 f"({FIGURES[name] or 'a count'}), got {value!r}")
        missing = [name for name in FIGURES if name not in self.sources]
        if missing:
            raise ValueError(f"hardware profile {self.name!r} cites no source for {', '.join(missing)}: every "
                             "figure needs one (a datasheet, a measurement, or 'estimate: how it was derived')")

    def peak_flops(self, precision: str) -> float:
        """Dense peak for the dtype the model computes in: fp32 for "fp32", bf16/fp16 tensor cores otherwise."""
        return self.peak_flops_fp32 if precision == "fp32" else self.peak_flops_bf16

    def cite(self, figure: str) -> str:
        if figure not in FIGURES:
            raise ValueError(f"unknown figure {figure!r}; a profile has {', '.join(FIGURES)}")
        return self.sources[figure]

    def replace(self, **changes) -> Hardware:
        """A copy with some figures changed (e.g. a faster link); `sources` of changed figures say so."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown figure(s) {sorted(unknown)}; a profile has {', '.join(FIGURES)}")
        sources = {**self.sources, **{k: "set by hand" for k in changes if k in FIGURES}}
        return dataclasses.replace(self, **{"sources": sources, **changes})

    def table(self) -> list[dict]:
        """One row per figure: name, value, unit, source (for a chapter's table)."""
        return [{"figure": name, "value": getattr(self, name), "unit": unit, "source": self.sources[name]}
                for name, unit in FIGURES.items()]


# ---------------------------------------------------------------------------------------------------
# Sources, named once. A preset cites them by key.

_SRC = {
    "a100": "NVIDIA A100 datasheet (80GB PCIe: HBM2e 1,935 GB/s; BF16 tensor 312 TFLOPS dense; FP32 19.5 TFLOPS)",
    "h100": "NVIDIA H100 datasheet (SXM5 80GB: HBM3 3.35 TB/s; BF16 tensor 989 TFLOPS dense; FP32 67 TFLOPS)",
    "h200": "NVIDIA H200 datasheet (SXM 141GB: HBM3e 4.8 TB/s; BF16 and FP32 as H100 SXM)",
    "gh200": "NVIDIA GH200 datasheet (H100 96GB HBM3 4 TB/s; NVLink-C2C 900 GB/s total = 450 GB/s each way; "
             "Grace: 72 Arm Neoverse V2 cores, up to 480 GB LPDDR5X at up to 512 GB/s)",
    "rtx4090": "NVIDIA Ada whitepaper, RTX 4090 (24 GB GDDR6X 1,008 GB/s; BF16 tensor with FP32 accumulate "
               "165.2 TFLOPS dense; FP32 82.6 TFLOPS; PCIe Gen4 x16)",
    "rtx4060l": "estimate: RTX 4060 Laptop GPU (8 GB GDDR6, 128-bit at 16 Gbps = 256 GB/s; 24 SMs; PCIe Gen4 x8); "
                "tensor and FP32 peaks scaled from the RTX 4090's by SM count x clock (24 x ~2.0 GHz vs 128 x "
                "2.52 GHz); depends on the laptop's power limit",
    "pcie4": "PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 encoding = 31.5 GB/s per direction",
    "pcie4x8": "PCIe 4.0 x8: 15.75 GB/s per direction",
    "pcie5": "PCIe 5.0 x16: 32 GT/s x 16 lanes x 128/130 encoding = 63 GB/s per direction",
    "pcie4_achieved": "estimate: ~80% of PCIe 4.0 x16 theoretical (CUDA bandwidthTest, pinned, typically 24-26 GB/s)",
    "pcie4x8_achieved": "estimate: ~80% of PCIe 4.0 x8 theoretical",
    "pcie5_achieved": "estimate: ~80% of PCIe 5.0 x16 theoretical (pinned copies typically 50-55 GB/s)",
    "c2c_achieved": "estimate: ~85% of NVLink-C2C's 450 GB/s per direction",
    "latency": "estimate: ~10 us per copy (launch and DMA set-up), typical of cudaMemcpyAsync",
    "launch": "estimate: ~5 us of host time to issue one cudaMemcpyAsync",
    "grad_hook": "estimate: ~30 us of host time per gradient in the offload engine's hook beyond the copy's launch "
                 "(an autograd hook into Python, the gradient counted into its subgroup or bucket, an event recorded: "
                 "a few dozen Python calls on a server core); profiles.probe() measures this machine's",
    "subgroup": "estimate: ~20 us of host time per subgroup in the offload engine's step beyond its bytes and its "
                "upload's launch (a CPU Adam call, its gradient zeroed, an event recorded: a dozen Python calls on a "
                "server core); profiles.probe() measures this machine's",
    "fetch": "estimate: ~50 us of host time per streamed block fetched and released (two module hooks, an allocation, "
             "a copy issue per home piece, an event, a free: a few dozen Python calls and one launch on a server "
             "core); profiles.probe() measures this machine's",
    "pack": "estimate: ~15 us of host time per saved tensor offloaded and brought back (a saved-tensors hook each way, "
            "a pooled pinned buffer, a copy issue each way); profiles.probe() measures this machine's",
    "collective": "estimate: ~25 us per collective whatever its size, NCCL's fixed cost (nccl-tests' time for an "
                  "all-reduce of a few bytes is tens of microseconds, within a node and across InfiniBand)",
    "file_read": "estimate: ~20 us per file read beyond its bytes (an open and a few system calls)",
    "commit_plp": "estimate: ~0.1 ms per durable write beyond its bytes (its fsyncs and the index renamed over): a "
                  "data-centre drive with power-loss protection acknowledges a flush in tens of microseconds",
    "commit_consumer": "estimate: ~2 ms per durable write beyond its bytes: a consumer drive without power-loss "
                       "protection writes its cache to flash on each fsync",
    "device_adam": "estimate: a fused fp32 AdamW moves 28 B/param; 80% of device_bandwidth / 28",
    "cpu_adam": "estimate: a fused CPU AdamW at 80% of host_bandwidth / 28 (chapter 3 reaches 0.8-0.95 of the "
                "roofline on our machine)",
    "epyc_7763": "estimate: one AMD EPYC 7763 socket (64 cores, 8 x DDR4-3200 = 204.8 GB/s theoretical), ~70% "
                 "achieved with a STREAM-like pattern, shared by the node's 4 GPUs",
    "spr_8480": "estimate: a DGX H100/H200 node's 2 x Xeon Platinum 8480C (56 cores and 8 x DDR5-4800 = 307 GB/s "
                "theoretical each), ~70% achieved, shared by 8 GPUs: a quarter socket per GPU",
    "grace": "estimate: Grace's LPDDR5X, ~80% of 512 GB/s achieved with a STREAM-like pattern",
    "ryzen_7950x": "estimate: a 16-core desktop (Ryzen 9 7950X) with 2 x DDR5-5600 = 89.6 GB/s theoretical, ~70% "
                   "achieved",
    "laptop_host": "estimate: an 8-core laptop with 2 x DDR5-5200 = 83.2 GB/s theoretical, ~65% achieved",
    "nvme_dc_gen4": "Samsung PM1733 datasheet (PCIe Gen4 U.2: 7.0 GB/s sequential read, 3.8 GB/s write); "
                    "one drive per GPU",
    "nvme_990pro": "Samsung 990 PRO datasheet (PCIe Gen4 M.2: 7.45 GB/s sequential read, 6.9 GB/s write)",
    "nvme_laptop": "estimate: a mid-range PCIe Gen4 laptop drive, 5 GB/s read, 4 GB/s write sequential",
    "dgx_a100": "estimate: a PCIe Gen4 server with 1 TiB of host memory shared by 4 GPUs (256 GiB each)",
    "dgx_h100": "NVIDIA DGX H100 datasheet: 2 TiB of host memory for 8 GPUs (256 GiB per GPU)",
    "gh200_host": "NVIDIA GH200 datasheet: 480 GB LPDDR5X, 72 cores (the whole Grace CPU per GPU)",
    "workstation": "estimate: a workstation with 128 GiB of host memory and 16 cores",
    "laptop": "estimate: a laptop with 32 GiB of host memory and 8 cores",
    # the machines of published setups (PAPER_PRESETS)
    "a100_sxm": "NVIDIA A100 datasheet (80GB SXM: HBM2e 2,039 GB/s; BF16 tensor 312 TFLOPS dense; FP32 19.5 TFLOPS)",
    "dgx_a100_host": "NVIDIA DGX A100 datasheet (640GB system): 2 TB of system memory (DIMMs: taken as 2 TiB) "
                     "and 2 x AMD EPYC 7742 (64 cores each) for 8 GPUs: 256 GiB and 16 cores per GPU",
    "epyc_7742": "estimate: 2 x AMD EPYC 7742 (8 x DDR4-3200 = 204.8 GB/s theoretical each), ~70% achieved with a "
                 "STREAM-like pattern, shared by 8 GPUs: a quarter socket per GPU",
    "nvme_dgx_a100": "estimate: DGX A100 datasheet's 8 x 3.84 TB U.2 NVMe data drives, one per GPU, taken at the "
                     "Samsung PM1733 datasheet's Gen4 rates (7.0 GB/s read, 3.8 GB/s write)",
    "v100": "NVIDIA V100 datasheet (SXM 32GB: HBM2 900 GB/s; FP32 15.7 TFLOPS) and DGX-2 datasheet (16 x V100 32GB, "
            "2 PFLOPS tensor = 125 TFLOPS each). V100 has no bf16: peak_flops_bf16 holds its FP16 tensor-core peak, "
            "what a mixed_fp16 model computes with",
    "pcie3": "PCIe 3.0 x16: 8 GT/s x 16 lanes x 128/130 encoding = 15.75 GB/s per direction",
    "pcie3_achieved": "estimate: ~80% of PCIe 3.0 x16 theoretical (pinned copies typically 12-13 GB/s)",
    "dgx2_host": "NVIDIA DGX-2 datasheet: 1.5 TB of system memory (DIMMs: taken as 1.5 TiB) and 2 x Xeon Platinum "
                 "8168 (24 cores each) for 16 GPUs: 96 GiB and 3 cores per GPU",
    "xeon_8168": "estimate: 2 x Xeon Platinum 8168 (6 x DDR4-2666 = 128 GB/s theoretical each), ~70% achieved, "
                 "shared by 16 GPUs: an eighth of a socket per GPU",
    "nvme_dgx2": "estimate: DGX-2 datasheet's 8 x 3.84 TB NVMe data drives for 16 GPUs (half a drive each); a PCIe "
                 "Gen3 x4 data-centre drive taken at ~3 GB/s read and ~2 GB/s write sequential",
    # between GPUs: `interconnect` (a ring collective's bus bandwidth per GPU) and `gpus_per_node`
    "nvlink4": "estimate: NVIDIA H100/H200 SXM datasheets: NVLink 4 at 900 GB/s per GPU (both directions) = 450 GB/s "
               "each way through NVSwitch; a ring collective's busbw taken as ~80% of it: 360 GB/s",
    "nvlink3": "estimate: NVIDIA A100 SXM datasheet: NVLink 3 at 600 GB/s per GPU (both directions) = 300 GB/s each "
               "way through NVSwitch; ~80% of it: 240 GB/s",
    "nvlink2": "estimate: NVIDIA V100 SXM datasheet and DGX-2 datasheet: NVLink 2 at 300 GB/s per GPU (both "
               "directions) = 150 GB/s each way through NVSwitch; ~80% of it: 120 GB/s",
    "pcie4_p2p": "estimate: PCIe peer-to-peer between the node's A100 PCIe cards through the socket's root complex (no "
                 "NVLink bridges): a ring is held to one Gen4 x16 direction, taken at its ~80% achieved, 25 GB/s",
    "staged_4090": "estimate: host-staged (GeForce RTX 40 cards have no PCIe peer-to-peer): each hop a D2H then an H2D "
                   "through pinned host memory, pipelined, ~half the achieved Gen4 x16 link: 12.5 GB/s (a what-if: the "
                   "workstation has one GPU)",
    "staged_laptop": "estimate: a laptop has one GPU; a what-if second one host-staged at ~half the achieved Gen4 x8 "
                     "link: 6.25 GB/s",
    "ib_ndr": "estimate: one InfiniBand NDR 400 Gb/s NIC per GH200 superchip = 50 GB/s each way; a ring across "
              "nodes taken at ~80% of it: 40 GB/s",
    "gh200_nvlink": "estimate: a 4-GH200 node (e.g. HPE Cray EX254n): each H100's 18 NVLink 4 links (450 GB/s each "
                    "way) split 6 per peer, 150 GB/s each way per pair; one ring uses one pair each way, NCCL's "
                    "several rings use more: taken as ~80% of two peers' links, 0.8 x 300 = 240 GB/s",
    "gpus_dgx_h100": "NVIDIA DGX H100/H200 datasheets: 8 GPUs per node",
    "gpus_pcie_node": "estimate: the PCIe Gen4 node above, 4 GPUs",
    "gpus_one": "one GPU in the machine",
    "gpus_gh200": "NVIDIA GH200 datasheet: one H100 per Grace CPU; superchips one per node, linked by InfiniBand",
    "gpus_4xgh200": "estimate: a 4-GH200 node (e.g. HPE Cray EX254n: 4 superchips on NVLink)",
    "gpus_dgx_a100": "NVIDIA DGX A100 datasheet: 8 GPUs per node",
    "gpus_dgx2": "NVIDIA DGX-2 datasheet: 16 GPUs per node",
}


def _share(value: float, gpus_per_socket: float) -> float:
    return value / gpus_per_socket


def _preset(name: str, description: str, *, device_memory, device_bandwidth, bf16, fp32, link_theoretical,
            link_achieved, host_memory, host_bandwidth, nvme_read, nvme_write, cores, interconnect, gpus_per_node,
            src: dict, nvme_write_overhead: float = 1e-4) -> Hardware:
    """A preset from its figures; the derived ones (device and CPU Adam rates) computed and cited here."""
    sources = {figure: _SRC[key] for figure, key in src.items()}
    sources.setdefault("link_latency", _SRC["latency"])
    sources.setdefault("copy_overhead", _SRC["launch"])
    for figure, key in (("grad_hook_overhead", "grad_hook"), ("subgroup_overhead", "subgroup"),
                        ("fetch_overhead", "fetch"), ("pack_overhead", "pack"),
                        ("collective_latency", "collective"),
                        ("nvme_read_overhead", "file_read"), ("nvme_write_overhead", "commit_plp")):
        sources.setdefault(figure, _SRC[key])
    sources.setdefault("device_adam_rate", _SRC["device_adam"])
    sources.setdefault("cpu_adam_rate", _SRC["cpu_adam"])
    sources.setdefault("link_d2h", sources["link_h2d"])
    return Hardware(
        name=name, description=description, device_memory=device_memory, device_bandwidth=device_bandwidth,
        peak_flops_bf16=bf16, peak_flops_fp32=fp32,
        device_adam_rate=0.8 * device_bandwidth / ADAM_BYTES_PER_PARAM,
        link_theoretical=link_theoretical, link_h2d=link_achieved, link_d2h=link_achieved, link_latency=10e-6,
        copy_overhead=5e-6, grad_hook_overhead=30e-6, subgroup_overhead=20e-6, fetch_overhead=50e-6,
        pack_overhead=15e-6,
        host_memory=host_memory, host_bandwidth=host_bandwidth,
        cpu_adam_rate=0.8 * host_bandwidth / ADAM_BYTES_PER_PARAM,
        nvme_read=nvme_read, nvme_write=nvme_write, nvme_read_overhead=20e-6, nvme_write_overhead=nvme_write_overhead,
        cores=cores, interconnect=interconnect, collective_latency=25e-6, gpus_per_node=gpus_per_node,
        sources=sources)


def _presets() -> dict[str, Hardware]:
    gpu = ("device_memory", "device_bandwidth", "peak_flops_bf16", "peak_flops_fp32")
    # H100 and H200 SXM: the same compute, the same DGX-like node (a quarter socket, a drive per GPU)
    hopper_node = dict(bf16=989e12, fp32=67e12, link_theoretical=63 * GB, link_achieved=50 * GB,
                       host_memory=256 * GiB, host_bandwidth=_share(0.7 * 307.2 * GB, 4), nvme_read=7.0 * GB,
                       nvme_write=3.8 * GB, cores=14, interconnect=0.8 * 450 * GB, gpus_per_node=8)
    hopper_src = {"link_theoretical": "pcie5", "link_h2d": "pcie5_achieved", "host_memory": "dgx_h100",
                  "host_bandwidth": "spr_8480", "cores": "spr_8480", "nvme_read": "nvme_dc_gen4",
                  "nvme_write": "nvme_dc_gen4", "interconnect": "nvlink4", "gpus_per_node": "gpus_dgx_h100"}
    out = [
        _preset("a100-pcie", "A100 80GB PCIe in a PCIe Gen4 node (4 GPUs on one EPYC 7763 socket)",
                device_memory=80 * GB, device_bandwidth=1935 * GB, bf16=312e12, fp32=19.5e12,
                link_theoretical=31.5 * GB, link_achieved=25 * GB, host_memory=256 * GiB,
                host_bandwidth=_share(0.7 * 204.8 * GB, 4), nvme_read=7.0 * GB, nvme_write=3.8 * GB, cores=16,
                interconnect=25 * GB, gpus_per_node=4,
                src={**dict.fromkeys(gpu, "a100"), "link_theoretical": "pcie4", "link_h2d": "pcie4_achieved",
                     "host_memory": "dgx_a100", "host_bandwidth": "epyc_7763", "cores": "epyc_7763",
                     "nvme_read": "nvme_dc_gen4", "nvme_write": "nvme_dc_gen4", "interconnect": "pcie4_p2p",
                     "gpus_per_node": "gpus_pcie_node"}),
        _preset("h100-sxm", "H100 SXM5 80GB in a DGX H100-like node (PCIe Gen5 host link; 8 GPUs, 2 sockets)",
                device_memory=80 * GB, device_bandwidth=3350 * GB, **hopper_node, src={**hopper_src, **dict.fromkeys(
                    gpu, "h100")}),
        _preset("h200", "H200 SXM 141GB in a DGX H200-like node (PCIe Gen5 host link; 8 GPUs, 2 sockets)",
                device_memory=141 * GB, device_bandwidth=4800 * GB, **hopper_node, src={**hopper_src, **dict.fromkeys(
                    gpu, "h200")}),
        _preset("gh200", "GH200 Grace Hopper superchip (H100 96GB, NVLink-C2C to a 72-core Grace)",
                device_memory=96 * GB, device_bandwidth=4000 * GB, bf16=989e12, fp32=67e12,
                link_theoretical=450 * GB, link_achieved=0.85 * 450 * GB, host_memory=480 * GB,
                host_bandwidth=0.8 * 512 * GB, nvme_read=7.0 * GB, nvme_write=3.8 * GB, cores=72,
                interconnect=0.8 * 50 * GB, gpus_per_node=1,
                src={**dict.fromkeys(gpu, "gh200"), "link_theoretical": "gh200", "link_h2d": "c2c_achieved",
                     "host_memory": "gh200_host", "host_bandwidth": "grace", "cores": "gh200_host",
                     "nvme_read": "nvme_dc_gen4", "nvme_write": "nvme_dc_gen4", "interconnect": "ib_ndr",
                     "gpus_per_node": "gpus_gh200"}),
        _preset("rtx4090", "RTX 4090 24GB workstation (PCIe Gen4 x16, 16-core desktop CPU)",
                device_memory=24 * GB, device_bandwidth=1008 * GB, bf16=165.2e12, fp32=82.6e12,
                link_theoretical=31.5 * GB, link_achieved=25 * GB, host_memory=128 * GiB,
                host_bandwidth=0.7 * 89.6 * GB, nvme_read=7.45 * GB, nvme_write=6.9 * GB, cores=16,
                interconnect=12.5 * GB, gpus_per_node=1, nvme_write_overhead=2e-3,
                src={**dict.fromkeys(gpu, "rtx4090"), "nvme_write_overhead": "commit_consumer",
                     "link_theoretical": "pcie4", "link_h2d": "pcie4_achieved",
                     "host_memory": "workstation", "host_bandwidth": "ryzen_7950x", "cores": "ryzen_7950x",
                     "nvme_read": "nvme_990pro", "nvme_write": "nvme_990pro", "interconnect": "staged_4090",
                     "gpus_per_node": "gpus_one"}),
        _preset("laptop", "a gaming laptop: RTX 4060 Laptop GPU 8GB on PCIe Gen4 x8, 8 cores, 32 GiB",
                device_memory=8 * GB, device_bandwidth=256 * GB, bf16=165.2e12 * 24 * 2.0 / (128 * 2.52),
                fp32=82.6e12 * 24 * 2.0 / (128 * 2.52), link_theoretical=15.75 * GB, link_achieved=12.5 * GB,
                host_memory=32 * GiB, host_bandwidth=0.65 * 83.2 * GB, nvme_read=5 * GB, nvme_write=4 * GB, cores=8,
                interconnect=6.25 * GB, gpus_per_node=1, nvme_write_overhead=2e-3,
                src={**dict.fromkeys(gpu, "rtx4060l"), "nvme_write_overhead": "commit_consumer",
                     "link_theoretical": "pcie4x8", "link_h2d": "pcie4x8_achieved",
                     "host_memory": "laptop", "host_bandwidth": "laptop_host", "cores": "laptop",
                     "nvme_read": "nvme_laptop", "nvme_write": "nvme_laptop", "interconnect": "staged_laptop",
                     "gpus_per_node": "gpus_one"}),
    ]
    return {hw.name: hw for hw in out}


def _paper_presets() -> dict[str, Hardware]:
    gpu = ("device_memory", "device_bandwidth", "peak_flops_bf16", "peak_flops_fp32")
    out = [
        _preset("a100-sxm", "A100 SXM4 80GB in a DGX A100-like node (PCIe Gen4 host link; 8 GPUs, 2 sockets)",
                device_memory=80 * GB, device_bandwidth=2039 * GB, bf16=312e12, fp32=19.5e12,
                link_theoretical=31.5 * GB, link_achieved=25 * GB, host_memory=256 * GiB,
                host_bandwidth=_share(0.7 * 204.8 * GB, 4), nvme_read=7.0 * GB, nvme_write=3.8 * GB, cores=16,
                interconnect=0.8 * 300 * GB, gpus_per_node=8,
                src={**dict.fromkeys(gpu, "a100_sxm"), "link_theoretical": "pcie4", "link_h2d": "pcie4_achieved",
                     "host_memory": "dgx_a100_host", "host_bandwidth": "epyc_7742", "cores": "dgx_a100_host",
                     "nvme_read": "nvme_dgx_a100", "nvme_write": "nvme_dgx_a100", "interconnect": "nvlink3",
                     "gpus_per_node": "gpus_dgx_a100"}),
        _preset("v100-dgx2", "V100 SXM 32GB, one GPU's share of a DGX-2 (PCIe Gen3 host link; 16 GPUs, 2 sockets)",
                device_memory=32 * GB, device_bandwidth=900 * GB, bf16=125e12, fp32=15.7e12,
                link_theoretical=15.75 * GB, link_achieved=12.6 * GB, host_memory=96 * GiB,
                host_bandwidth=_share(0.7 * 128 * GB, 8), nvme_read=1.5 * GB, nvme_write=1.0 * GB, cores=3,
                interconnect=0.8 * 150 * GB, gpus_per_node=16,
                src={**dict.fromkeys(gpu, "v100"), "link_theoretical": "pcie3", "link_h2d": "pcie3_achieved",
                     "host_memory": "dgx2_host", "host_bandwidth": "xeon_8168", "cores": "dgx2_host",
                     "nvme_read": "nvme_dgx2", "nvme_write": "nvme_dgx2", "interconnect": "nvlink2",
                     "gpus_per_node": "gpus_dgx2"}),
    ]
    return {hw.name: hw for hw in out}


def _node_presets(presets: dict[str, Hardware]) -> dict[str, Hardware]:
    """Whole nodes for sharded offload (issue 17): still one GPU's share each, with the node's GPU count and the
    bandwidth between its GPUs."""

    def node(base: str, name: str, description: str, **changes) -> Hardware:
        hw = presets[base]
        sources = {**hw.sources, **{figure: _SRC[key] for figure, key in changes.pop("src", {}).items()}}
        return dataclasses.replace(hw, name=name, description=description, sources=sources, **changes)

    out = [
        node("h100-sxm", "8xh100-sxm", "a DGX H100-like node: 8 x h100-sxm on NVLink 4 (NVSwitch), each GPU with its "
             "own PCIe Gen5 link, quarter socket and drive"),
        node("gh200", "4xgh200", "a 4-GH200 node: 4 superchips on NVLink 4, each H100 with its own NVLink-C2C, Grace "
             "and drive", interconnect=0.8 * 300 * GB, gpus_per_node=4,
             src={"interconnect": "gh200_nvlink", "gpus_per_node": "gpus_4xgh200"}),
        node("gh200", "gh200-ib", "GH200 superchips one per node on InfiniBand NDR 400 Gb/s"),
    ]
    return {hw.name: hw for hw in out}


PRESETS: dict[str, Hardware] = _presets()
# The machines of published setups (streaming_cost checks them on paper), and whole nodes for sharded offload. They
# are kept out of PRESETS, whose rows the chapters' tables print; `preset(name)` finds them too.
PAPER_PRESETS: dict[str, Hardware] = _paper_presets()
NODE_PRESETS: dict[str, Hardware] = _node_presets(PRESETS)


def preset(name: str) -> Hardware:
    """A cited profile by name; an unknown name lists the valid ones (and `probe()` for this machine)."""
    for table in (PRESETS, PAPER_PRESETS, NODE_PRESETS):
        if name in table:
            return table[name]
    raise ValueError(f"unknown hardware preset {name!r}; choose one of "
                     f"{', '.join([*PRESETS, *PAPER_PRESETS, *NODE_PRESETS])} (or profiles.probe() for this machine)")


# ---------------------------------------------------------------------------------------------------
# This machine

GLOO_LOOPBACK = 1.28 * GB  # B/s: bytes one rank sends (shards.ring_bytes) per second, gloo, 2 processes, one machine
GLOO_LOOPBACK_SOURCE = (
    "measured: bench/gloo.py on the course's 2-core build VM (torch 2.13 CPU, 2 processes, loopback TCP), 2026-12-03: "
    "a 16 MiB fp32 broadcast, the bytes a rank sends by the step model's count (shards.ring_bytes: half the buffer "
    "with 2 ranks) over its time less the fixed cost; median of 3 runs 1.28 GB/s [1.01, 1.35]. Pass interconnect= to "
    "probe() with your own measurement")


GLOO_LATENCY = 250e-6  # s per collective: gloo between 2 processes on one machine (source below)
GLOO_LATENCY_SOURCE = (
    "measured: bench/gloo.py on the course's 2-core build VM, 2026-12-03: an all-reduce of one fp32 value between 2 "
    "processes, median of 3 runs 251 us [240, 281]")


@functools.lru_cache(maxsize=8)
def probe(link_bandwidth: float | None = None, nvme_dir: str | None = None, quick: bool = True,
          interconnect: float | None = None) -> Hardware:
    """This machine as a profile: the simulated device (its link model, its memory, its modelled device
    Adam) on the host's measured figures: Adam-pattern memory bandwidth, a fused CPU Adam's rate, matmul
    FLOP/s, the drive under `nvme_dir` (a temporary directory when None) with its cost per file, and what each
    runtime call costs on the sim beyond its bytes (a copy's issue and latency, a streamed block's fetch, a saved
    tensor's offload). Cached per arguments: the
    chapters share one measurement per kernel. `link_bandwidth` defaults to the sim device's default link.
    `interconnect`: B/s between ranks, measured by the caller (gloo between processes on this machine); by default
    GLOO_LOOPBACK, measured once as its source says. The ranks share this host (`gpus_per_node` 1: a sim device per
    process).

    On the sim the device IS the host (`shared_host=True`): its compute, memory and bandwidth are the
    host's, and work the two would do in parallel on a GPU server competes here.
    """
    import inspect
    import os
    import tempfile

    import torch

    from ..devices.common import Link
    from ..devices.sim import SLOW_LINK, SimDevice
    from . import measure as hardware

    link = link_bandwidth or SLOW_LINK.bandwidth
    size = 20_000_000 if quick else 50_000_000
    host_bw = hardware.adam_roofline(size, repeats=3)
    cpu_adam = hardware.cpu_adam_rate(size, repeats=3)
    one_thread_adam = hardware.cpu_adam_rate(size, repeats=3, threads=1)
    flops = hardware.matmul_flops()
    flops_bf16 = hardware.matmul_flops(dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory(dir=nvme_dir) as scratch:
        disk = hardware.disk_bandwidth(scratch, (64 if quick else 256) << 20)
    with tempfile.TemporaryDirectory(dir=nvme_dir) as scratch:
        per_file = hardware.file_costs(scratch)
    with SimDevice(h2d=Link(link), d2h=Link(link)) as dev:
        per_copy = hardware.copy_costs(dev)
    with SimDevice(h2d=Link(1e12), d2h=Link(1e12), strict=False) as dev:  # bytes free: each call's cost is left
        per_fetch, per_pack = hardware.fetch_cost(dev), hardware.pack_cost(dev)
        per_grad, per_subgroup = hardware.grad_cost(dev), hardware.subgroup_cost(dev)
    defaults = inspect.signature(SimDevice).parameters
    memory_bytes, adam_rate = defaults["memory_bytes"].default, defaults["adam_rate"].default
    measured = f"measured on this machine by profiles.probe() ({os.cpu_count()} cores, torch {torch.__version__})"
    simulated = "the simulated device's model (SimDevice defaults)"
    sources = {figure: measured for figure in FIGURES}
    sources.update({"device_memory": simulated,
                    "device_adam_rate": "the slower of the sim's modelled rate (SimDevice adam_rate) and its real "
                                        "run, chapter 3's fused Adam on one thread, measured by profiles.probe()",
                    "link_latency": "measured: the sim's per-copy time beyond bytes / bandwidth (its 10 us model plus "
                                    "its stream thread's wake-up), by profiles.probe()",
                    "copy_overhead": "measured: host time to issue one copy to the sim, by profiles.probe()",
                    "grad_hook_overhead": "measured: what one gradient adds to backward on the sim when OffloadAdam "
                                          "takes it, bytes and the copy's issue aside (measure.grad_cost), by "
                                          "profiles.probe()",
                    "subgroup_overhead": "measured: what one more subgroup adds to OffloadAdam's step on the sim, "
                                         "bytes and its upload's issue aside (measure.subgroup_cost), by "
                                         "profiles.probe()",
                    "fetch_overhead": "measured: what a streamed block's fetch and release add to forward and backward "
                                      "on the sim, bytes aside (measure.fetch_cost), by profiles.probe()",
                    "pack_overhead": "measured: what a saved tensor's offload and return add to forward and backward "
                                     "on the sim, bytes aside (measure.pack_cost), by profiles.probe()",
                    "nvme_read": "measured: the Swapper's read rate less each file's fixed cost, by profiles.probe()",
                    "nvme_write": "measured: the Swapper's write rate less each file's commit, by profiles.probe()",
                    "nvme_read_overhead": "measured: a 4 KiB file read through the Swapper (measure.file_costs)",
                    "nvme_write_overhead": "measured: a 4 KiB file's durable write through the Swapper (its commit: "
                                           "fsyncs, the index renamed over; measure.file_costs)",
                    "collective_latency": GLOO_LATENCY_SOURCE,
                    "link_h2d": "the simulated device's Link model" if link_bandwidth is None else "set by the caller",
                    "link_theoretical": "the simulated device's Link model (no slot: theoretical = modelled)",
                    "device_bandwidth": "the host's (the sim device computes in host memory): " + measured,
                    "peak_flops_bf16": "bf16 matmul of this CPU: " + measured,
                    "host_memory": "os.sysconf (physical memory)",
                    "interconnect": GLOO_LOOPBACK_SOURCE if interconnect is None else "measured by the caller",
                    "gpus_per_node": "one simulated device per process"})
    sources["link_d2h"] = sources["link_h2d"]
    return Hardware(
        name="this machine (sim)", description=f"simulated device on this {os.cpu_count()}-core machine",
        device_memory=memory_bytes, device_bandwidth=host_bw, peak_flops_bf16=flops_bf16, peak_flops_fp32=flops,
        device_adam_rate=min(adam_rate, one_thread_adam), link_theoretical=link, link_h2d=link, link_d2h=link,
        link_latency=per_copy["latency"], copy_overhead=per_copy["issue"],
        grad_hook_overhead=max(per_grad - per_copy["issue"], 1e-7),
        subgroup_overhead=max(per_subgroup - per_copy["issue"], 1e-7),
        host_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        fetch_overhead=per_fetch, pack_overhead=per_pack,
        host_bandwidth=host_bw, cpu_adam_rate=cpu_adam, nvme_read=_net(disk["read"], disk["bytes_per_file"],
                                                                        per_file["read"]),
        nvme_write=_net(disk["write"], disk["bytes_per_file"], per_file["write"]),
        nvme_read_overhead=per_file["read"], nvme_write_overhead=per_file["write"],
        cores=os.cpu_count() or 1, interconnect=interconnect or GLOO_LOOPBACK, collective_latency=GLOO_LATENCY,
        gpus_per_node=1, shared_host=True, sources=sources)


def _net(rate: float, nbytes: int, per_file: float) -> float:
    """A drive's rate without its per-file cost: `rate` was measured over files of `nbytes`, each paying `per_file`
    seconds besides its bytes (the step model charges the two apart). At least the measured rate: a per-file cost
    measured larger than a whole file's time (a burst of other work) takes nothing away."""
    return max(rate, nbytes / max(nbytes / rate - per_file, 0.5 * nbytes / rate))
