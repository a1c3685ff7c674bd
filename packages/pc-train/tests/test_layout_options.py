"""The layout's options are declared once (pc_train.options.LayoutOptions):
PluginOptions, pc-train's TrainConfig and flags, and pc-estimate's flags
all come from its fields, with one name and one default each."""

from __future__ import annotations

from dataclasses import MISSING, fields

import pytest

from pc_train.estimate import _parser as estimate_parser
from pc_train.options import LAYOUT_HELP, LayoutOptions, PluginKind, PluginOptions
from pc_train.train_config import TrainConfig, parse_args
from pc_train.train_config import _parser as train_parser

LAYOUT = list(fields(LayoutOptions))


def test_every_layout_field_has_help_and_a_default() -> None:
    assert {f.name for f in LAYOUT} == set(LAYOUT_HELP)
    assert all(f.default is not MISSING for f in LAYOUT)


def test_plugin_options_and_train_config_take_the_layout_from_one_place() -> None:
    plugin = {f.name: f.default for f in fields(PluginOptions) if f.name != "kind"}
    train = {f.name: f.default for f in fields(TrainConfig)}
    for item in LAYOUT:
        assert plugin[item.name] == item.default
        assert train[item.name] == item.default
    # Declared once: neither class declares a layout field of its own.
    assert not set(PluginOptions.__annotations__) & set(LAYOUT_HELP)
    assert not set(TrainConfig.__annotations__) & set(LAYOUT_HELP)


@pytest.mark.parametrize("which", ["pc-train", "pc-estimate"])
def test_both_commands_have_a_flag_per_field_with_its_default(which: str) -> None:
    parser = train_parser() if which == "pc-train" else estimate_parser()
    flags = {a.dest: a for a in parser._actions}
    for item in LAYOUT:
        assert item.name in flags, (which, item.name)
        assert LAYOUT_HELP[item.name] in (flags[item.name].help or "")
    if which == "pc-estimate":
        parsed = vars(parser.parse_args([]))
        assert {f.name: parsed[f.name] for f in LAYOUT} == {f.name: f.default for f in LAYOUT}


def test_a_flag_reaches_the_plugin_options_alike_from_both_commands() -> None:
    argv = ["--plugin", "hybrid", "--sp", "2", "--sp-mode", "ring_attn", "--pp-style", "zbv"]
    argv += ["--activation-checkpointing", "selective", "--compile", "--microbatches", "4"]
    from_train = parse_args(argv).plugin_options()
    args = estimate_parser().parse_args(argv)
    from_estimate = PluginOptions.parse(
        args.plugin, **{f.name: getattr(args, f.name) for f in LAYOUT}
    )
    assert from_train == from_estimate
    assert from_train.kind is PluginKind.HYBRID
    assert (from_train.sp, from_train.sp_mode, from_train.pp_style) == (2, "ring_attn", "zbv")
    assert from_train.compile
    assert from_train.microbatches == 4
