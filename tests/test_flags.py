"""Flags declared once, on options fields (:mod:`hf_symmetry.flags`): the parser gets exactly the flags declared,
the options come back from the parsed arguments, and the commands build their options this way."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from hf_symmetry.calibration import CalibrationText
from hf_symmetry.flags import Flag, add_flags, changed_flags, flag, from_args, nested, nested_from_args


def _channels(text: str) -> tuple[int, ...]:
    return tuple(int(c) for c in text.split(",") if c.strip())


@dataclass(frozen=True)
class Options:
    rank: int | None = flag(None, "the rank (default: exact)", type=int)
    mode: str = flag("auto", "how", choices=["auto", "qk", "vo"])
    ffn: bool = flag(True, "permute (default: on)", action=argparse.BooleanOptionalAction)
    scaling: bool = flag(False, "also scale", action="store_true")
    pow2: bool = flag(False, "round", name="--pow2-scales", action="store_true")
    hold_out: tuple[int, ...] = flag((), "channels", metavar="I,J", unset="", parse=_channels)
    seed: int = 0  # no flag
    calibration: CalibrationText | None = nested(
        CalibrationText,
        text=Flag("calibration text", name="--calib", metavar="FILE", unset=None),
        tokens=Flag("calibration tokens", name="--calib-tokens", type=int, unset=64),
    )


def _by_hand() -> argparse.ArgumentParser:
    """The parser one would write without the declarations (the negative control's reference)."""
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--rank", type=int, default=None, help="the rank (default: exact)")
    p.add_argument("--mode", choices=["auto", "qk", "vo"], default="auto", help="how")
    p.add_argument("--ffn", action=argparse.BooleanOptionalAction, default=True, help="permute (default: on)")
    p.add_argument("--scaling", action="store_true", help="also scale")
    p.add_argument("--pow2-scales", action="store_true", help="round")
    p.add_argument("--hold-out", metavar="I,J", default="", help="channels")
    p.add_argument("--calib", metavar="FILE", default=None, help="calibration text")
    p.add_argument("--calib-tokens", type=int, default=64, help="calibration tokens")
    return p


def _generated(*names: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="x")
    add_flags(p, Options, *names)
    return p


def test_the_generated_parser_is_the_one_written_by_hand():
    assert _generated().format_help() == _by_hand().format_help()
    argv = ["--rank", "3", "--no-ffn", "--pow2-scales", "--hold-out", "1,5", "--calib", "t.txt"]
    assert vars(_generated().parse_args(argv)) == vars(_by_hand().parse_args(argv))
    # negative control: a flag declared differently (another help) gives another help text
    p = argparse.ArgumentParser(prog="x")
    add_flags(p, Options, "mode", "rank")  # the order is the names' order
    assert p.format_help() != _by_hand().format_help()
    assert p.format_help().index("--mode") < p.format_help().index("--rank")


def test_options_come_back_from_the_parsed_flags():
    args = _generated().parse_args(["--rank", "3", "--no-ffn", "--pow2-scales", "--hold-out", "1,5", "--calib", "t"])
    got = from_args(Options, args, seed=7)
    assert got == Options(
        rank=3, ffn=False, pow2=True, hold_out=(1, 5), seed=7, calibration=CalibrationText("t", tokens=64)
    )
    # no --calib: no calibration (the nested field's default), whatever --calib-tokens says
    plain = from_args(Options, _generated().parse_args(["--calib-tokens", "9"]))
    assert plain == Options() and plain.calibration is None
    # flags the parser lacks keep the field's default; given values win over parsed ones
    partial = from_args(Options, _generated("mode").parse_args(["--mode", "qk"]), rank=2)
    assert partial == Options(mode="qk", rank=2)


@dataclass(frozen=True)
class Run:
    """A nested field whose default is a value (compress's ``CompressRun.calibration``), its flags shown apart."""

    calibration: CalibrationText = nested(
        CalibrationText,
        CalibrationText("embedded", tokens=128),
        text=Flag("calibration text", name="--calib", metavar="FILE", unset=None),
        tokens=Flag("calibration tokens", name="--calib-tokens", type=int, unset=128),
    )


def test_one_flag_of_a_nested_field_and_the_nested_value_the_flags_give():
    p = argparse.ArgumentParser(prog="x")
    add_flags(p, Run, "calibration.tokens")  # only that flag, where the command shows it
    p.add_argument("--between")
    add_flags(p, Run, "calibration.text")
    help_text = p.format_help()
    assert help_text.index("--calib-tokens") < help_text.index("--between") < help_text.index("--calib FILE")
    given = nested_from_args(Run, "calibration", p.parse_args(["--calib", "t.txt", "--calib-tokens", "9"]))
    assert given == CalibrationText("t.txt", tokens=9)
    # no --calib: None (no text given), not the field's default, whatever --calib-tokens says
    assert nested_from_args(Run, "calibration", p.parse_args(["--calib-tokens", "9"])) is None
    assert from_args(Run, p.parse_args([])) == Run()  # from_args keeps the field's default
    with pytest.raises(KeyError, match="calibration.seq_len"):  # negative control: a flag not declared
        add_flags(argparse.ArgumentParser(), Run, "calibration.seq_len")


def test_changed_flags_name_what_was_given_as_typed():
    args = _generated().parse_args(["--no-ffn", "--scaling", "--mode", "vo"])
    assert changed_flags(Options, args) == ["--mode", "--no-ffn", "--scaling"]
    assert changed_flags(Options, _generated().parse_args([])) == []
    assert changed_flags(Options, args, "scaling") == ["--scaling"]


def test_a_field_without_a_flag_is_refused_by_name():
    with pytest.raises(KeyError, match="seed"):
        add_flags(argparse.ArgumentParser(), Options, "seed")


def test_to_tpa_builds_its_options_from_the_declared_flags():
    from hf_symmetry.cli import build_parser
    from hf_symmetry.conversion.to_tpa import ToTPAOptions

    args = build_parser().parse_args(["to-tpa", "m", "o", "--k-rank", "2", "--calib", "c.txt", "--calib-tokens", "96"])
    assert from_args(ToTPAOptions, args) == ToTPAOptions(k_rank=2, calibration=CalibrationText("c.txt", 96))
    args = build_parser().parse_args(["to-tpa", "m", "o", "--v-rank", "1"])
    assert from_args(ToTPAOptions, args) == ToTPAOptions(v_rank=1)


def test_rotate_farr_and_match_build_their_options_from_the_declared_flags():
    """The options each command builds are those the flags say (each field once), preset filled in for rotate."""
    from hf_symmetry.cli import build_parser
    from hf_symmetry.commands.rotate import resolve_quantization_preset, rotate_options
    from hf_symmetry.conversion.farr import FarrOptions
    from hf_symmetry.conversion.match.options import MatchOptions
    from hf_symmetry.conversion.rotate import RotateOptions

    argv = [
        "rotate",
        "m",
        "o",
        "--for-quantization",
        "--hold-out",
        "1,3",
        "--pow2-scales",
        "--calibration-tokens",
        "64",
    ]
    args = build_parser().parse_args(argv)
    resolve_quantization_preset(args)
    assert rotate_options(args) == RotateOptions(
        residual="hadamard", for_quantization=True, hold_out=(1, 3), scales_pow2=True, calibration_tokens=64
    )
    args = build_parser().parse_args(["rotate", "m", "o", "--no-ffn", "--heads", "qk", "--seed", "5"])
    resolve_quantization_preset(args)
    assert rotate_options(args) == RotateOptions(ffn=False, heads="qk", seed=5)
    args = build_parser().parse_args(["match", "a", "b", "o", "--no-ffn", "--residual", "--residual-iters", "2"])
    assert from_args(MatchOptions, args) == MatchOptions(ffn=False, residual=True, residual_iters=2)
    args = build_parser().parse_args(["merge", "a", "b", "o", "--method", "average", "--heads", "vo", "--no-ffn"])
    assert changed_flags(MatchOptions, args) == ["--heads", "--no-ffn"]
    args = build_parser().parse_args(["farr", "m", "o", "--tau", "0.9", "--qk"])
    assert from_args(FarrOptions, args, vo=args.vo or not args.qk) == FarrOptions(tau=0.9, vo=False, qk=True)
    with pytest.raises(SystemExit):  # --tau and --params-fraction: one of them, exactly
        build_parser().parse_args(["farr", "m", "o", "--tau", "0.9", "--params-fraction", "0.5"])
