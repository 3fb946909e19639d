"""The settings' one vocabulary (options.Placement beside OffloadOptions) and its one table of rules: each rule
refused with its one message from every entry point (check_run / check_model, OffloadOptions, StepConfig, TrainConfig,
Plan, the step and train commands); the two commands' flags made from the same fields; a plan run and predicted
through its one owner."""

import dataclasses
import re

import pytest

from minioffload import options
from minioffload.cli import main as cli
from minioffload.machine import profiles
from minioffload.options import MODEL, RUN, OffloadOptions, Placement
from minioffload.planner import search as planner
from minioffload.planner.plan import Plan
from minioffload.predict import shapes, stepmodel
from minioffload.predict.stepmodel import StepConfig
from minioffload.train.loop import TrainConfig

R = options

# one case per rule: (the rule, the placement, the options) breaking that rule alone
CASES = [
    (R._one_split, {}, {"gpu_fraction": 0.5, "stride": 2}),
    (R._delay_offloads_all, {}, {"delay_updates_after": 0, "min_offload_numel": 10}),
    (R._delay_or_hybrid, {}, {"delay_updates_after": 0, "stride": 2}),
    (R._speculative_alone, {}, {"speculative": True, "stride": 2}),
    (R._offload_only, {"optimizer_on": "device"}, {"stride": 2}),
    (R._streamed_needs_offload, {"optimizer_on": "device", "params_on": "host"}, {}),
    (R._ranks_need_offload, {"optimizer_on": "device", "ranks": 2}, {}),
    (R._streamed_synchronous, {"params_on": "host"}, {"gpu_fraction": 0.5}),
    (R._nvme_synchronous, {"optimizer_on": "nvme"}, {"delay_updates_after": 0}),
    (R._sharded_synchronous, {"ranks": 2}, {"delay_updates_after": 0}),
    (R._speculative_resident, {"params_on": "host"}, {"speculative": True}),
    (R._speculative_on_host, {"optimizer_on": "nvme"}, {"speculative": True}),
    (R._ranks_resident, {"ranks": 2, "params_on": "host"}, {}),
    (R._grads_on_nvme_tier, {"grads_on": "nvme"}, {}),
    (R._grads_on_nvme_synchronous, {"optimizer_on": "nvme", "grads_on": "nvme"}, {"bucket_numel": 64}),
]
IDS = [rule.__name__ for rule, _, _ in CASES]
OPTIONS_ALONE = {R._one_split, R._delay_offloads_all, R._delay_or_hybrid, R._speculative_alone}
PLAN_OPTIONS = {"delay_updates_after", "gpu_fraction"}  # what a Plan's own fields say of its options


def _options(fields: dict) -> OffloadOptions:
    """The options of a case, built past the rules of the options alone (the table is what is tested)."""
    made = OffloadOptions()
    for name, value in fields.items():
        object.__setattr__(made, name, value)
    return made


def _scopes(rule) -> tuple[str, ...]:
    return next(holds for r, holds in R._RULES if r is rule)


def test_every_rule_of_the_table_has_a_case_that_breaks_it_alone():
    assert [rule for rule, _ in R._RULES] == [rule for rule, _, _ in CASES]
    for rule, where, fields in CASES:
        p, o = Placement(**where), _options(fields)
        assert [r for r, _ in R._RULES if r(p, o)] == [rule], rule.__name__


@pytest.mark.parametrize("rule, where, fields", CASES, ids=IDS)
def test_each_rule_is_refused_with_its_one_message_by_check_run_and_check_model(rule, where, fields):
    p, o = Placement(**where), _options(fields)
    message = rule(p, o)
    for check, scope in ((options.check_run, RUN), (options.check_model, MODEL)):
        if scope in _scopes(rule):
            with pytest.raises(ValueError) as err:
                check(p, o)
            assert str(err.value) == message
        else:
            check(p, o)  # the other side holds no such rule
    if rule in OPTIONS_ALONE:  # refused where the options are made, with the same words
        with pytest.raises(ValueError) as err:
            OffloadOptions(**fields)
        assert str(err.value) == message


@pytest.mark.parametrize("rule, where, fields", [c for c in CASES if c[0] not in OPTIONS_ALONE],
                         ids=[i for i, c in zip(IDS, CASES, strict=True) if c[0] not in OPTIONS_ALONE])
def test_each_rule_is_refused_with_its_one_message_by_step_config_train_config_and_plan(
        rule, where, fields, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p, o = Placement(**where), OffloadOptions(**fields)
    message, scopes = rule(p, o), _scopes(rule)
    if MODEL in scopes:
        with pytest.raises(ValueError) as err:
            StepConfig(p, o)
        assert str(err.value) == message
        with pytest.raises(ValueError) as err:
            StepConfig(**where, **fields)
        assert str(err.value) == message
    else:
        StepConfig(p, o)
    train = {"offload": p.offloaded, "params_on": p.params_on, "prefetch": p.prefetch, "shard": p.ranks > 1,
             "nvme_dir": "somewhere" if p.optimizer_on == "nvme" else None, "grads_on": p.grads_on}
    if RUN in scopes:
        with pytest.raises(ValueError) as err:
            TrainConfig(optimizer=o, **train)
        assert str(err.value) == message
    else:
        assert TrainConfig(optimizer=o, **train).placement == p
    if set(fields) <= PLAN_OPTIONS:
        spec = shapes.ModelSpec.of_preset("tiny")
        with pytest.raises(ValueError) as err:
            Plan(spec, "laptop", "fp32", 1, 1, p.optimizer_on, p.params_on, ("keep",) * spec.n_layer, p.prefetch,
                 delay="delay_updates_after" in fields, gpu_fraction=fields.get("gpu_fraction"), ranks=p.ranks,
                 grads_on=p.grads_on)
        assert str(err.value) == f"Plan: {message}"


def _flags(where: dict, fields: dict) -> list[str]:
    return [arg for name, value in {**where, **fields}.items() for arg in (options.flag(name), str(value))]


@pytest.mark.parametrize("rule, where, fields", CASES, ids=IDS)
def test_each_rule_is_refused_with_its_one_message_by_the_step_and_train_commands(
        rule, where, fields, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    message, scopes = rule(Placement(**where), _options(fields)), _scopes(rule)
    if MODEL in scopes:
        with pytest.raises(SystemExit):
            cli.main(["step", *_flags(where, fields)])
        words = cli.TRAIN_SPELLING.sub(lambda m: m[0].split(" (train: ")[0], message)
        assert f"error: {options.name_flags(words)}\n" in capsys.readouterr().err
    if RUN in scopes:
        train = [*_flags({k: v for k, v in where.items() if k in cli.TRAIN_PLACEMENT}, fields),
                 *(["--no-offload"] if where.get("optimizer_on") == "device" else []),
                 *(["--nvme-dir", str(tmp_path)] if where.get("optimizer_on") == "nvme" else []),
                 *(["--shard"] if where.get("ranks", 1) > 1 else [])]
        with pytest.raises(SystemExit):
            cli.main(["train", "--out-dir", str(tmp_path / "run"), *train])
        err = capsys.readouterr().err
        words = cli.TRAIN_SPELLING.sub(lambda m: cli.TRAIN_FLAGS[m[1]], message)
        names = (*(f.name for f in dataclasses.fields(OffloadOptions)), *cli.TRAIN_PLACEMENT)
        assert f"error: {options.name_flags(words, names)}\n" in err, err


@pytest.mark.parametrize("name, value, says", [
    ("optimizer_on", "gpu", "one of 'device', 'host', 'nvme'"), ("params_on", "disk", "one of 'device', 'host'"),
    ("prefetch", -1, "an int >= 0"), ("prefetch", True, "an int >= 0"), ("ranks", 0, "an int >= 1"),
    ("ranks", 1.5, "an int >= 1"),
])
def test_each_placement_field_refuses_a_bad_value_naming_it(name, value, says):
    with pytest.raises(ValueError, match=rf"^{name} must be {re.escape(says)}.*got {re.escape(repr(value))}"):
        Placement(**{name: value})
    with pytest.raises(TypeError, match="unknown placement field.*Placement has optimizer_on"):
        Placement().replace(homes="host")


def _flag_actions(parser) -> dict:
    return {a.option_strings[0]: (a.dest, a.type, a.help, a.metavar) for a in parser._actions if a.option_strings}


def _subparsers(argv_command: str):
    import argparse

    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers()
    return cli.add_step_parser(commands) if argv_command == "step" else cli.add_train_parser(commands)


def test_the_step_and_train_commands_expose_the_same_settings_flags():
    step, train = _flag_actions(_subparsers("step")), _flag_actions(_subparsers("train"))
    settings = [options.flag(f.name) for f in dataclasses.fields(OffloadOptions)]
    settings += [options.flag(name) for name in cli.TRAIN_PLACEMENT]
    for flag in settings:
        assert flag in step and flag in train and step[flag] == train[flag], flag
    assert {"--optimizer-on", "--ranks"} <= step.keys()  # train's are --offload/--nvme-dir and torchrun's ranks
    defaults = _subparsers("step").parse_args([])
    assert options.from_flags(defaults) == OffloadOptions()  # subgroup_numel 1 << 22: the options' own defaults
    assert options.from_flags(defaults, Placement) == Placement()


def test_a_plan_runs_and_is_predicted_through_its_one_owner():
    hw = profiles.preset("laptop")
    plans = planner.search(shapes.ModelSpec.of_preset("tiny"), hw, planner.Limits(batch=4, precision="fp32"))
    for p in plans[:6]:
        config = p.train_config(nvme_dir="somewhere")
        assert config.placement == p.placement and config.optimizer == p.options
        assert planner.train_config(p, nvme_dir="somewhere") == config
        step = p.step_config(0.5)
        assert (step.placement, step.options, step.mfu) == (p.placement, p.options, 0.5)
        assert planner.prediction(p, hw).step_s == stepmodel.predict(
            p.model.workload(p.micro_batch * p.model.seq_len, p.precision), hw, p.step_config()).step_s
    sharded = dataclasses.replace(plans[0], optimizer_on="host", params_on="device", prefetch=0, ranks=2)
    assert sharded.train_config().shard and sharded.step_config().placement.ranks == 2
