"""The `specdec` command and the engine flags: `specdec --help` lists the subcommands, each subcommand
is its entry point (the same flags and --help), every EngineConfig field is exactly one flag of every
command that builds an `LLM`, and those flags read back into the EngineConfig of the same values."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from eval import command
from eval.humaneval import HUMANEVAL
from eval.math500 import MATH500
from specdec import cli, generate, serve
from specdec.arguments import engine_options, flag_name
from specdec.engine.config import EngineConfig

REPO = Path(__file__).resolve().parents[2]

# every command that builds an LLM, and the EngineConfig its flags give when none is passed
PARSERS = {
    "generate": (generate.build_parser, EngineConfig()),
    "serve": (serve.build_parser, EngineConfig()),
    # an eval runs one request at a time unless --concurrency (= --max-num-seqs) says otherwise
    "math500": (lambda: command.build_parser(MATH500), EngineConfig(max_num_seqs=1)),
    "humaneval": (lambda: command.build_parser(HUMANEVAL), EngineConfig(max_num_seqs=1)),
}

# a value unlike the default for every field, so that a flag read back into the wrong field shows
SAMPLE_VALUES = dict(device="cuda:1", dtype="float16", kv_cache_dtype="fp8", page_size=8, num_kv_pages=100,
                     gpu_memory_utilization=0.5, cpu_kv_cache_gib=1.5, max_num_seqs=3, max_prefill_tokens=128,
                     max_model_len=4096,
                     attention_backend="torch", calibrate_fp8_scales=True, drafter_kv_cache_dtype="fp8_e4m3",
                     enforce_eager=True, kv_cache_full_precision_layers="0,1", overlap_steps=False, verify_ahead=True,
                     verify_ahead_batches="off",
                     verify="tree", tree_nodes=31, budget_steps=True, draft_window=2048, draft_vocab=16384,
                     enable_prefix_caching=False)


def help_text(capsys, run, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run(argv)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def after_usage(text: str) -> str:
    """--help without its usage lines, which wrap by the length of the program's name."""
    return text.split("\n\n", 1)[1]


def as_flags(values: dict) -> list[str]:
    flags = []
    for setting in fields(EngineConfig):
        value = values[setting.name]
        if isinstance(value, bool):  # a switch: --x sets a field that is off by default, --no-x clears one that is on
            flags += [] if value == setting.default else [flag_name(setting) if value else f"--no-{flag_name(setting)[2:]}"]
        else:
            flags += [flag_name(setting), str(value)]
    return flags


# ---- 1. `specdec --help` and the command groups -------------------------------------------------
@pytest.mark.parametrize("argv, commands", [([], ["generate", "serve", "eval", "bench"]),
                                            (["eval"], ["math500", "humaneval"]),
                                            (["bench"], ["steps", "serve", "peers"])], ids=["top", "eval", "bench"])
def test_help_lists_the_subcommands_one_line_each(capsys, argv, commands):
    text = help_text(capsys, cli.main, [*argv, "--help"])
    group = cli.SPECDEC.commands[argv[0]] if argv else cli.SPECDEC
    for name in commands:
        (line,) = [line for line in text.splitlines() if line.split()[:1] == [name]]
        assert group.commands[name].summary in line
    assert " ".join(["specdec", *argv, "COMMAND", "--help"]) in text


def test_help_loads_no_torch():
    code = "import sys; from specdec import cli\ntry: cli.main(['--help'])\nexcept SystemExit: pass\n" \
           "print('torch' in sys.modules, file=sys.stderr)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stderr.strip() == "False" and "generate" in proc.stdout


@pytest.mark.parametrize("argv, expected", [([], "required: COMMAND"), (["nope"], "invalid choice: 'nope'"),
                                            (["eval", "gsm8k"], "invalid choice: 'gsm8k'")])
def test_missing_or_unknown_subcommand_exits_2(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


# ---- 2. a subcommand is its entry point ---------------------------------------------------------
@pytest.mark.parametrize("argv, old_main, prog", [
    (["generate"], generate.main, "specdec generate"),
    (["serve"], serve.main, "specdec serve"),
    (["eval", "math500"], importlib.import_module("eval.math500").main, "specdec eval math500"),
    (["eval", "humaneval"], importlib.import_module("eval.humaneval").main, "specdec eval humaneval"),
], ids=["generate", "serve", "math500", "humaneval"])
def test_subcommand_help_is_the_entry_points(capsys, argv, old_main, prog):
    new = help_text(capsys, cli.main, [*argv, "--help"])
    old = help_text(capsys, old_main, ["--help"])
    assert new.startswith(f"usage: {prog} [-h]")
    assert after_usage(new) == after_usage(old)


def test_subcommand_arguments_reach_the_entry_point(monkeypatch):
    seen = []
    monkeypatch.setattr(generate, "main", lambda argv, prog: seen.append((argv, prog)) or 7)
    assert cli.main(["generate", "--prompt", "-x", "--", "--device", "cpu"]) == 7
    assert seen == [(["--prompt", "-x", "--", "--device", "cpu"], "specdec generate")]


@pytest.mark.parametrize("name", ["steps", "serve", "peers"])
def test_bench_subcommand_runs_the_script(capsys, monkeypatch, name):
    script = REPO / "scripts" / f"bench_{name}.py"
    monkeypatch.setattr(sys, "argv", [str(script)])  # argparse names the program after the script, as runpy does
    old = help_text(capsys, importlib.import_module(f"scripts.bench_{name}").parse_args, ["--help"])
    monkeypatch.setattr(sys, "argv", ["specdec"])
    assert help_text(capsys, cli.main, ["bench", name, "--help"]) == old
    assert sys.argv == ["specdec"]  # restored after the script ran


def test_bench_without_a_source_checkout_is_one_error_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "CHECKOUT", tmp_path)
    assert cli.main(["bench", "steps", "--quick"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith("error: bench_steps.py ") and str(tmp_path) in err and "pip install -e" in err


def test_console_script_is_registered():
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    for line in ('specdec = "specdec.cli:main"', 'specdec-generate = "specdec.generate:main"',
                 'specdec-serve = "specdec.serve:main"'):
        assert line in text


# ---- 3. every EngineConfig field is exactly one flag --------------------------------------------
@pytest.mark.parametrize("name", PARSERS)
def test_every_engine_field_is_exactly_one_flag(name):
    parser = PARSERS[name][0]()
    for setting in fields(EngineConfig):
        actions = [a for a in parser._actions if a.dest == setting.name]
        assert len(actions) == 1, f"{name}: EngineConfig.{setting.name} has {len(actions)} flags"
        assert actions[0].option_strings[0] == flag_name(setting)
        assert actions[0].help == setting.metadata["help"], f"EngineConfig.{setting.name} needs metadata help"
        others = [a for a in parser._actions if a is not actions[0] and flag_name(setting) in a.option_strings]
        assert not others


@pytest.mark.parametrize("name", PARSERS)
def test_no_flags_give_the_commands_default_config(name):
    build, expected = PARSERS[name]
    assert EngineConfig(**engine_options(build().parse_args([]))) == expected


def test_defaults_in_help_are_the_dataclass_defaults(capsys):
    text = " ".join(help_text(capsys, generate.main, ["--help"]).split())
    for setting in fields(EngineConfig):
        assert flag_name(setting) in text and f"(default: {setting.default})" in text


def test_eval_concurrency_is_max_num_seqs():
    args = command.parse_args(MATH500, ["--concurrency", "4"])
    assert args.max_num_seqs == args.concurrency == 4 and engine_options(args)["max_num_seqs"] == 4
    assert command.parse_args(MATH500, ["--max-num-seqs", "5"]).concurrency == 5


# ---- 4. flags round-trip into the EngineConfig of the same values -------------------------------
def test_sample_values_cover_every_field():
    assert set(SAMPLE_VALUES) == {f.name for f in fields(EngineConfig)}, "give the new field a sample value"
    assert all(SAMPLE_VALUES[f.name] != f.default for f in fields(EngineConfig))


@pytest.mark.parametrize("name", PARSERS)
def test_flags_round_trip_into_engine_config(name):
    args = PARSERS[name][0]().parse_args(as_flags(SAMPLE_VALUES))
    assert EngineConfig(**engine_options(args)) == EngineConfig(**SAMPLE_VALUES)


def test_engine_options_are_llm_keywords():
    args = argparse.Namespace(**SAMPLE_VALUES, unrelated="x")
    assert engine_options(args) == SAMPLE_VALUES


def test_engine_options_reject_what_engine_config_rejects():
    args = generate.parse_args(["--num-kv-pages", "0"])
    with pytest.raises(ValueError, match="num_kv_pages must be positive"):
        engine_options(args)
