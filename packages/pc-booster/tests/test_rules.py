"""The plugins' rules as data [Note: one place for every rule]: every
rule's example breaks it, the options of every plugin validate where
nothing is known yet, and an unknown setting never refuses."""

from __future__ import annotations

import pytest

from pc_booster.plugins import PLUGIN_OPTIONS
from pc_booster.rules import PluginConfig, Rule, RunSetting, TrainPrecision, example_message


@pytest.mark.parametrize("config", PLUGIN_OPTIONS, ids=lambda c: c.name)
def test_every_rule_refuses_its_example_and_names_the_plugin(config: type[PluginConfig]) -> None:
    rules: tuple[Rule, ...] = config.rules()
    assert rules, config
    for rule in rules:
        message = example_message(config, rule)
        assert message.endswith("."), message  # a sentence, with the fix
        changes, setting = rule.example
        with pytest.raises(ValueError, match=config.__name__.removesuffix("Options")):
            config(**changes).validate(setting)


@pytest.mark.parametrize("config", PLUGIN_OPTIONS, ids=lambda c: c.name)
def test_defaults_are_accepted_in_fp32_and_when_nothing_is_known(
    config: type[PluginConfig],
) -> None:
    options = config()
    options.validate(RunSetting())
    options.validate(RunSetting(world=4, precision=TrainPrecision.FP32, accumulation=2))
    assert options.build().options == options  # the plugin keeps exactly these options


def test_precision_parsing() -> None:
    assert TrainPrecision.parse(None) is TrainPrecision.FP32
    assert TrainPrecision.parse("bf16") is TrainPrecision.BF16
    with pytest.raises(ValueError, match="precision must be 'fp16', 'bf16', 'fp32' or None"):
        TrainPrecision.parse("fp8")
