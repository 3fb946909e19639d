"""Streamed parameters on paper: the GPT-3 shape family, the largest model each machine fits, the published setups,
and the hardware presets they need."""

from itertools import pairwise

import pytest

from minioffload.machine import profiles
from minioffload.predict import streaming_cost as sc
from minioffload.units import GB


def test_the_family_reproduces_gpt3_and_grows_with_its_width():
    assert sc.shape(12288).num_params == pytest.approx(175e9, rel=0.005)
    assert sc.shape(4096).num_params == pytest.approx(6.7e9, rel=0.02)
    assert sc.shape(5120) == sc.Shape(40, 5120, 40)
    counts = [sc.shape(d).num_params for d in range(768, 30000, 128)]
    assert all(b > a for a, b in pairwise(counts))
    assert sc.shape(16384) == sc.Shape(128, 16384, 128)  # extrapolated at 175B's aspect ratio
    between = sc.shape(8192)
    assert 40 < between.n_layer < 96 and between.n_head == 64
    assert sc.shape_for(1e12).num_params == pytest.approx(1e12, rel=0.01)
    with pytest.raises(ValueError, match="multiple of 128"):
        sc.shape(1000)


@pytest.mark.parametrize("name", ["rtx4090", "h100-sxm", "v100-dgx2"])
def test_the_largest_fit_fits_and_the_next_width_does_not(name):
    hw = profiles.preset(name)
    for home in ("host", "nvme"):
        fit = sc.largest_fit(hw, home)
        assert fit.needed["device"] <= hw.device_memory and fit.needed["host"] <= hw.host_memory
        bigger = sc.needed_bytes(sc.shape(fit.model.d_model + 128), home, 2)
        assert bigger["device"] > hw.device_memory or bigger["host"] > hw.host_memory
        assert fit.prediction.step_s > 0 and fit.prediction.fetch_s > 0
    # NVMe as the home leaves the host only the gradients: a larger model fits
    assert sc.largest_fit(hw, "nvme").model.num_params > sc.largest_fit(hw, "host").model.num_params


def test_largest_fits_covers_every_preset_and_both_homes():
    rows = sc.largest_fits()
    names = [*profiles.PRESETS, *profiles.PAPER_PRESETS]
    assert [(r.hardware, r.params_on) for r in rows] == [(n, h) for n in names for h in ("host", "nvme")]
    assert all(r.model is not None and "params on" in str(r) for r in rows)


def test_published_setups_each_produce_a_verdict():
    verdicts = {v.setup.split()[0]: v for v in sc.published_setups()}
    assert set(verdicts) == {"SynergyScale", "ZeRO-Infinity", "Fuyou"}
    for v in verdicts.values():
        assert v.model.num_params == pytest.approx(v.claimed_params, rel=0.02)
        assert v.fits == (not v.over) and v.params_on in ("host", "nvme")
        capacity = {"device": v.hardware.device_memory, "host": v.hardware.host_memory}
        assert set(v.over) == {t for t in capacity if v.needed[t] > capacity[t]}
        assert v.prediction.step_s > 0 and len(v.assumptions) >= 4
        assert ("does not fit" in str(v)) != v.fits
    # what our model says, and why
    assert verdicts["SynergyScale"].fits and verdicts["SynergyScale"].params_on == "nvme"
    fuyou = verdicts["Fuyou"]
    assert fuyou.over == ("host",)  # 6 B/param of gradients in host memory: ~1 TB against 256 GiB
    assert fuyou.needed["host"] >= 6 * fuyou.model.num_params > fuyou.hardware.host_memory
    zi = verdicts["ZeRO-Infinity"]
    assert "device" in zi.over and zi.hardware.device_memory == 32 * GB  # one 1T block does not leave room
    assert zi.tokens == 16 * 2048 and zi.hardware.peak_flops("mixed_fp16") == 16 * 125e12


@pytest.mark.parametrize("name", profiles.PAPER_PRESETS)
def test_paper_presets_are_cited_and_found_by_name(name):
    hw = profiles.preset(name)
    assert hw is profiles.PAPER_PRESETS[name] and name not in profiles.PRESETS
    for row in hw.table():
        assert row["value"] > 0 and len(row["source"]) > 10, (name, row["figure"])
    assert hw.link_h2d <= hw.link_theoretical
    assert hw.cpu_adam_rate == pytest.approx(0.8 * hw.host_bandwidth / 28)


def test_datasheet_figures_of_the_paper_presets():
    a100, v100 = profiles.preset("a100-sxm"), profiles.preset("v100-dgx2")
    assert a100.device_bandwidth == 2039 * GB and a100.peak_flops_bf16 == 312e12
    assert v100.device_memory == 32 * GB and v100.peak_flops_bf16 == 125e12 and v100.link_theoretical == 15.75 * GB
    assert "no bf16" in v100.cite("peak_flops_bf16") and v100.cite("nvme_read").startswith("estimate:")
