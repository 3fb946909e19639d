"""OffloadOptions: every field's check and every rule, each with its message; the CLI flags made from the fields."""

import argparse
import dataclasses
import re

import pytest

from minioffload import options
from minioffload.options import OffloadOptions, Placement, check_run


@pytest.mark.parametrize("name, value, says", [
    ("subgroup_numel", 0, "a positive int"), ("subgroup_numel", 2.0, "a positive int"),
    ("max_grad_norm", 0.0, "positive number"), ("max_grad_norm", float("nan"), "positive number"),
    ("loss_scale", "static", "'dynamic' or a positive number"), ("loss_scale", -1, "positive number"),
    ("growth_interval", 0, "a positive int"), ("min_offload_numel", -1, "an int >= 0"),
    ("delay_updates_after", -2, "an int >= 0"), ("delay_updates_after", True, "an int >= 0"),
    ("gpu_fraction", 1.5, "in [0, 1]"), ("gpu_fraction", True, "in [0, 1]"), ("stride", 0, "an int >= 1"),
    ("stride", 1.5, "an int >= 1"), ("nvme_buffers", 2, "at least 3"),
])
def test_each_field_refuses_a_bad_value_naming_it(name, value, says):
    with pytest.raises(ValueError, match=rf"^{name} must be .*{re.escape(says)}.*got") as err:
        OffloadOptions(**{name: value})
    assert repr(value) in str(err.value)


@pytest.mark.parametrize("settings, says", [
    ({"gpu_fraction": 0.5, "stride": 2}, "not both"),
    ({"delay_updates_after": 0, "min_offload_numel": 10}, "needs every parameter offloaded"),
    ({"delay_updates_after": 0, "stride": 2}, "do not combine"),
    ({"delay_updates_after": 0, "gpu_fraction": 0.0}, "do not combine"),
])
def test_each_rule_across_options_has_its_message(settings, says):
    with pytest.raises(ValueError, match=says):
        OffloadOptions(**settings)


def test_the_nvme_rule_and_what_only_the_offloaded_optimizer_has():
    check_run(Placement(optimizer_on="nvme"), OffloadOptions(max_grad_norm=1.0))  # fine
    with pytest.raises(ValueError, match="NVMe tier does not combine"):
        check_run(Placement(optimizer_on="nvme"), OffloadOptions(stride=3))
    assert OffloadOptions().offload_only() == []
    assert OffloadOptions(stride=3, min_offload_numel=5, max_grad_norm=1.0).offload_only() == [
        "min_offload_numel", "stride"]


def test_replace_checks_and_names_unknown_options():
    base = OffloadOptions(subgroup_numel=100)
    assert base.replace(stride=2) == OffloadOptions(subgroup_numel=100, stride=2)
    assert base.replace() == base
    with pytest.raises(TypeError, match="unknown option.*strides.*OffloadOptions has subgroup_numel"):
        base.replace(strides=2)
    with pytest.raises(ValueError, match="not both"):
        base.replace(stride=2, gpu_fraction=0.5)


def test_the_split_rules_alone_are_the_options_rules():
    options.check_split(None, 3)
    with pytest.raises(ValueError, match="^stride must be an int >= 1"):
        options.check_split(None, 0)


def test_a_flag_per_field_with_its_default_and_parse():
    parser = argparse.ArgumentParser()
    options.add_flags(parser, OffloadOptions(subgroup_numel=64))
    flags = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(OffloadOptions)} <= flags
    got = options.from_flags(parser.parse_args(["--stride", "3", "--max-grad-norm", "none", "--loss-scale",
                                                "dynamic"]))
    assert got == OffloadOptions(subgroup_numel=64, stride=3, loss_scale="dynamic")
    assert options.from_flags(parser.parse_args(["--loss-scale", "128"])).loss_scale == 128.0
    with pytest.raises(ValueError, match="^--stride must be an int >= 1 .every stride-th"):
        options.from_flags(parser.parse_args(["--stride", "0"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-grad-norm", "lots"])
