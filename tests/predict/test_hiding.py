"""The closed-form conditions of predict/hiding.py against the step model that implies them: on every GPU preset, at
0.8x a condition's threshold the step model exposes the work, at 1.25x it hides it."""

import math

import pytest

from minioffload.machine import profiles
from minioffload.predict import activation_cost, hiding, stepmodel
from minioffload.predict.shapes import ModelSpec

SPEC = ModelSpec.of_params(7e9)
GPUS = [name for name, hw in profiles.PRESETS.items() if not hw.shared_host]
BELOW, ABOVE = 0.8, 1.25


def predict_at(condition: hiding.Condition, factor: float, **config) -> stepmodel.Prediction:
    tokens = max(1, round(condition.threshold * factor))
    return stepmodel.predict(SPEC.workload(tokens), profiles.preset(config.pop("hw")), stepmodel.StepConfig(**config))


@pytest.mark.parametrize("name", GPUS)
@pytest.mark.parametrize("home", ["host", "nvme"])
def test_a_streamed_fetch_hides_above_its_threshold_and_not_below(name, home):
    hw = profiles.preset(name)
    condition = hiding.streamed_fetch(SPEC.workload(2048), hw, home)
    # the optimizer in host memory: its NVMe tier would share the drive (the NVMe state condition, not this one)
    config = {"hw": name, "params_on": home, "optimizer_on": "host", "prefetch": 1}
    below, above = predict_at(condition, BELOW, **config), predict_at(condition, ABOVE, **config)
    fetch = condition.work_s  # one block's fetch: it does not depend on the tokens
    # below: each forward block waits 0.2 of a fetch (6.4 fetches over 32 blocks); above: only the pipeline's fill
    # and turn (the first block's read and copy, which nothing precedes, and the turn into the backward)
    assert below.exposed_fetch_s >= 0.15 * SPEC.n_layer * fetch
    assert above.exposed_fetch_s <= 4 * fetch


@pytest.mark.parametrize("name", GPUS)
def test_gradient_copies_hide_under_the_backward_above_their_threshold(name):
    condition = hiding.gradient_copies(SPEC.workload(2048), profiles.preset(name))
    below, above = predict_at(condition, BELOW, hw=name), predict_at(condition, ABOVE, hw=name)
    assert below.exposed["d2h"] >= 0.05 * condition.work_s
    assert above.exposed["d2h"] <= 0.01 * condition.work_s


@pytest.mark.parametrize("name", GPUS)
def test_a_delayed_update_stops_bounding_the_step_above_its_threshold(name):
    condition = hiding.delayed_update(SPEC.workload(2048), profiles.preset(name))
    below = predict_at(condition, BELOW, hw=name, delay_updates_after=0)
    above = predict_at(condition, ABOVE, hw=name, delay_updates_after=0)
    assert below.bound == "cpu" and above.bound != "cpu"
    assert above.exposed["cpu"] < below.exposed["cpu"]


@pytest.mark.parametrize("name", GPUS)
def test_activation_offload_hides_above_its_link_threshold(name):
    hw = profiles.preset(name)
    block = activation_cost.BlockShape(2048, 4, SPEC.d_model, SPEC.n_head)
    condition = hiding.activation_offload(block, hw)
    for factor, hidden in ((BELOW, False), (ABOVE, True)):
        link = condition.threshold * factor
        fast = hw.replace(link_h2d=link, link_d2h=link, link_latency=1e-12)
        hooks = block.saved_tensors() * fast.pack_overhead  # host time: no link hides it
        extra = activation_cost.policy_costs(block, fast)["offload"].extra_s
        assert (extra == pytest.approx(hooks, rel=1e-9)) is hidden
        assert hiding.activation_offload(block, fast).hides() is hidden


def test_at_the_threshold_the_two_sides_meet():
    hw = profiles.preset("h100-sxm")
    for condition_of in (hiding.streamed_fetch, hiding.gradient_copies, hiding.delayed_update, hiding.checkpoint_write):
        threshold = condition_of(SPEC.workload(2048), hw).threshold
        at = condition_of(SPEC.workload(math.ceil(threshold)), hw)
        assert at.work_s == pytest.approx(at.under_s, rel=1e-3) and at.hides()
    drive = hiding.nvme_state(hw)
    assert drive.hides() == (drive.work_s <= drive.under_s)


def test_what_cannot_hide_is_refused_with_the_reason():
    work = SPEC.workload(2048)
    with pytest.raises(ValueError, match="shared host"):
        hiding.streamed_fetch(work, profiles.preset("h100-sxm").replace(shared_host=True))
    with pytest.raises(ValueError, match="home must be 'host' or 'nvme'"):
        hiding.streamed_fetch(work, profiles.preset("h100-sxm"), home="disk")
    with pytest.raises(ValueError, match="mfu"):
        hiding.delayed_update(work, profiles.preset("h100-sxm"), mfu=0)
    with pytest.raises(TypeError, match="profiles.Hardware"):
        hiding.nvme_state("h100-sxm")
