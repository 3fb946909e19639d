"""The hardware table: every preset figure positive and cited, bad names and bad figures refused clearly."""

import dataclasses

import pytest

from minioffload.machine import profiles
from minioffload.machine.profiles import FIGURES, PRESETS, Hardware


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_figure_is_positive_and_cited(name):
    hw = profiles.preset(name)
    for row in hw.table():
        assert row["value"] > 0, (name, row["figure"])
        assert len(row["source"]) > 10, (name, row["figure"])  # a real citation, not a placeholder
    # achieved never beats theoretical; the derived rates follow their stated rule
    assert hw.link_h2d <= hw.link_theoretical and hw.link_d2h <= hw.link_theoretical
    assert hw.device_adam_rate == pytest.approx(0.8 * hw.device_bandwidth / 28)
    assert hw.cpu_adam_rate == pytest.approx(0.8 * hw.host_bandwidth / 28)
    assert hw.peak_flops("mixed_bf16") == hw.peak_flops_bf16 and hw.peak_flops("fp32") == hw.peak_flops_fp32


def test_datasheet_figures_the_chapters_quote():
    assert profiles.preset("h200").device_bandwidth == 4.8e12 and profiles.preset("h200").device_memory == 141e9
    assert profiles.preset("h100-sxm").device_bandwidth == 3.35e12
    # H100/H200 SXM nodes are PCIe Gen5 hosts; the A100 PCIe and the RTX 4090 are Gen4
    assert profiles.preset("h100-sxm").link_theoretical == pytest.approx(63e9)
    assert profiles.preset("a100-pcie").link_theoretical == pytest.approx(31.5e9)
    assert "Gen5" in profiles.preset("h200").description


def test_an_unknown_preset_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown hardware preset 'h300'.*a100-pcie, h100-sxm, h200, gh200"):
        profiles.preset("h300")


@pytest.mark.parametrize("figure", ["link_h2d", "cores", "nvme_write"])
@pytest.mark.parametrize("bad", [-1.0, 0, float("nan"), None, True])
def test_a_bad_figure_names_the_field(figure, bad):
    hw = profiles.preset("rtx4090")
    fields = {f.name: getattr(hw, f.name) for f in dataclasses.fields(hw)}
    with pytest.raises(ValueError, match=f"'rtx4090': {figure} must be a positive finite number"):
        Hardware(**{**fields, figure: bad})


def test_a_missing_figure_or_source_is_named():
    hw = profiles.preset("laptop")
    fields = {f.name: getattr(hw, f.name) for f in dataclasses.fields(hw)}
    del fields["host_bandwidth"]
    with pytest.raises(TypeError, match="host_bandwidth"):
        Hardware(**fields)
    fields = {f.name: getattr(hw, f.name) for f in dataclasses.fields(hw)}
    fields["sources"] = {k: v for k, v in hw.sources.items() if k != "nvme_read"}
    with pytest.raises(ValueError, match="cites no source for nvme_read"):
        Hardware(**fields)


def test_replace_marks_changed_figures_and_refuses_unknown_ones():
    hw = profiles.preset("h100-sxm").replace(link_h2d=10e9)
    assert hw.link_h2d == 10e9 and hw.cite("link_h2d") == "set by hand"
    assert profiles.preset("h100-sxm").link_h2d == 50e9  # the table itself is unchanged
    with pytest.raises(ValueError, match="unknown figure"):
        hw.replace(pcie=1)
    with pytest.raises(ValueError, match="unknown figure 'pcie'"):
        hw.cite("pcie")


def test_probe_describes_this_machine_as_a_shared_host():
    hw = profiles.probe()
    assert hw.shared_host and hw.cores >= 1
    assert set(hw.sources) >= set(FIGURES)
    assert hw.device_bandwidth == hw.host_bandwidth  # the sim's device memory is the host's
    assert hw.link_h2d == 2e9  # the sim's default link
    assert profiles.probe() is hw  # cached: chapters share one measurement


def test_the_gpu_sizes_chapter_1_uses_come_from_the_table():
    from minioffload.predict import memory

    assert memory.GPUS == {"H100 80 GB": profiles.preset("h100-sxm").device_memory,
                           "H200 141 GB": profiles.preset("h200").device_memory}


@pytest.mark.parametrize("name", [*PRESETS, *profiles.PAPER_PRESETS, *profiles.NODE_PRESETS])
def test_every_profile_has_a_cited_interconnect_and_node_size(name):
    hw = profiles.preset(name)
    assert hw.interconnect > 0 and isinstance(hw.gpus_per_node, int) and hw.gpus_per_node >= 1
    assert len(hw.cite("interconnect")) > 10 and len(hw.cite("gpus_per_node")) > 10


def test_node_presets_for_sharded_offload():
    h100, node = profiles.preset("h100-sxm"), profiles.preset("8xh100-sxm")
    assert node.gpus_per_node == 8 and node.interconnect == h100.interconnect == pytest.approx(0.8 * 450e9)
    assert node.host_memory == h100.host_memory  # still one GPU's share of the host
    quad, ib = profiles.preset("4xgh200"), profiles.preset("gh200-ib")
    assert quad.gpus_per_node == 4 and quad.interconnect > ib.interconnect == pytest.approx(0.8 * 50e9)
    assert quad.link_h2d == profiles.preset("gh200").link_h2d  # each GPU keeps its own NVLink-C2C
    assert "NDR" in ib.cite("interconnect") and "NVLink" in quad.cite("interconnect")
    assert "host-staged" in profiles.preset("rtx4090").cite("interconnect")
    assert "peer-to-peer" in profiles.preset("a100-pcie").cite("interconnect")
    assert not set(profiles.NODE_PRESETS) & set(PRESETS)  # the chapters' tables print PRESETS only


def test_probe_interconnect_is_the_gloo_estimate_unless_measured():
    hw = profiles.probe()
    assert hw.interconnect == profiles.GLOO_LOOPBACK and "gloo" in hw.cite("interconnect")
    assert hw.gpus_per_node == 1
    measured = profiles.probe(interconnect=1.5e9)
    assert measured.interconnect == 1.5e9 and measured.cite("interconnect") == "measured by the caller"
