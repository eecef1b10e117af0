"""The command line's errors and edges: bad prompts files, a model without a chat template, Ctrl-C,
a closed stdout, `--help` defaults, the demo's prompt and length notes, bad device strings and engine
settings. Each runs `specdec.generate.main` in-process (one case a real subprocess) on a tiny CPU model."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import generate
from specdec.arguments import add_engine_arguments, add_model_arguments
from specdec.engine.engine import Engine
from specdec.engine.sampling_params import SamplingParams
from tests.engine_helpers import failing_at

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random tiny model with a real byte-level tokenizer (no chat template) saved beside it."""
    from tests.conftest import build_tiny_model_with_tokenizer

    path = tmp_path_factory.mktemp("tiny-cli-model")
    build_tiny_model_with_tokenizer(path)
    return path


def tiny_args(path, *more):
    return ["--target", str(path), "--device", "cpu", "--dtype", "float32", "--no-drafter", "--num-kv-pages", "256",
            "--page-size", "4", *more]


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error:" in line]


# ---- 1. prompts files ---------------------------------------------------------------------------
def prompts_file_error(tiny_dir, file, content: bytes, capsys) -> str:
    """The one error line of generate run on a prompts file holding `content`; nothing else printed."""
    file.write_bytes(content)
    assert generate.main(tiny_args(tiny_dir, "--no-chat", "--prompts-file", str(file))) == 2
    out, err = capsys.readouterr()
    assert out == ""  # the demo prompt did not run
    (line,) = error_lines(err)
    assert "Traceback" not in err and err.strip() == line and str(file) in line
    return line


@pytest.mark.parametrize("content", [b"", b"\n\n   \n\t\n"], ids=["empty", "blank"])
def test_prompts_file_without_prompts_is_an_error(tiny_dir, tmp_path, capsys, content):
    line = prompts_file_error(tiny_dir, tmp_path / "prompts.txt", content, capsys)
    assert line.startswith("error: ") and "has no prompts" in line


@pytest.mark.parametrize("content", [b"\xff\xfe\x00h\x00i\x80\x81", b"ok\x00\x00\x00binary\n"], ids=["not-utf8", "nul"])
def test_binary_prompts_file_is_one_line_error(tiny_dir, tmp_path, capsys, content):
    line = prompts_file_error(tiny_dir, tmp_path / "prompts.bin", content, capsys)
    assert "UTF-8" in line or "binary" in line


def test_unreadable_prompts_file_exits_2(tmp_path, capsys):
    assert generate.main(["--prompts-file", str(tmp_path / "missing.txt")]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "missing.txt" in line


# ---- 2. chat template ---------------------------------------------------------------------------
def test_chat_without_template_says_use_no_chat(tiny_dir, capsys):
    assert generate.main(tiny_args(tiny_dir, "--prompt", "Hello", "--max-new-tokens", "4")) == 2  # --chat is default
    out, err = capsys.readouterr()
    (line,) = error_lines(err)
    assert "chat template" in line and "--no-chat" in line
    assert "Traceback" not in err
    # and with --no-chat it runs
    assert generate.main(tiny_args(tiny_dir, "--no-chat", "--prompt", "Hello", "--max-new-tokens", "4")) == 0


# ---- 3. Ctrl-C and a closed stdout --------------------------------------------------------------
@pytest.mark.parametrize("overlap", ["--overlap-steps", "--no-overlap-steps"], ids=["overlapped", "in-order"])
@pytest.mark.parametrize("prompts", [["Hello world"], ["Hello world", "The quick brown fox"]], ids=["one", "two"])
def test_ctrl_c_prints_partial_stats_and_exits_130(tiny_dir, capsys, monkeypatch, prompts, overlap):
    monkeypatch.setattr(Engine, "step", failing_at(7, KeyboardInterrupt())(Engine.step))
    prompt_args = [a for p in prompts for a in ("--prompt", p)]
    code = generate.main(tiny_args(tiny_dir, "--no-chat", "--ignore-eos", "--max-new-tokens", "100", overlap,
                                   *prompt_args))
    assert code == 130
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert "tok/s" in err and "request(s)" in err  # the stats line of what had been generated
    assert "interrupted" in err.lower()
    # six steps ran before the interrupt, each giving every request a token; with overlapped steps the
    # sixth step's tokens were still on the device (never committed, so neither streamed nor counted)
    per_request = 6 if overlap == "--no-overlap-steps" else 5
    assert f"{per_request * len(prompts)} tokens from {len(prompts)} request(s)" in err
    if len(prompts) == 1:
        assert out.strip()  # the streamed text before the interrupt


def test_ctrl_c_while_loading_exits_130(tiny_dir, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "LLM", interrupted)
    assert generate.main(tiny_args(tiny_dir, "--no-chat", "--prompt", "Hi")) == 130
    assert "interrupted" in capsys.readouterr().err.lower()


def test_closed_stdout_exits_quietly(tiny_dir):
    """`python -m specdec.generate ... | head -1`: the reader has gone before the first token."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to the child's stdout fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "specdec.generate",
                               *tiny_args(tiny_dir, "--no-chat", "--prompt", "Hello", "--max-new-tokens", "16")],
                              stdout=write_end, stderr=subprocess.PIPE, cwd=REPO, timeout=300)
    finally:
        os.close(write_end)
    err = proc.stderr.decode()
    assert proc.returncode in (0, 141), err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err


# ---- 4. --help shows defaults -------------------------------------------------------------------
def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 512)", "(default: 0.0)", "(default: auto)", "(default: 16)", "(default: 0.9)",
                    "(default: qwen2.5-coder-1.5b-instruct)"):
        assert default in text, default
    for action in generate.build_parser()._actions:
        assert action.help, action.option_strings


@pytest.mark.parametrize("add", [add_model_arguments, add_engine_arguments])
def test_shared_arguments_show_defaults_in_any_parser(add):
    p = argparse.ArgumentParser()
    add(p)
    text = " ".join(p.format_help().split())
    assert "(default: " in text
    assert all(action.help for action in p._actions)


# ---- 5. the demo --------------------------------------------------------------------------------
def test_cli_default_max_new_tokens_is_512_library_default_unchanged():
    assert generate.parse_args([]).max_new_tokens == 512
    assert SamplingParams().max_new_tokens == 256


def test_one_prompt_is_shown_and_length_stop_is_explained(tiny_dir, capsys):
    assert generate.main(tiny_args(tiny_dir, "--no-chat", "--ignore-eos", "--max-new-tokens", "5",
                                   "--prompt", "Hello world")) == 0
    out, err = capsys.readouterr()
    assert "prompt: Hello world" in err
    assert "[stopped at --max-new-tokens 5; raise it for a longer answer]" in err
    assert out.strip()


def test_several_prompts_length_stop_is_explained(tiny_dir, capsys):
    assert generate.main(tiny_args(tiny_dir, "--no-chat", "--ignore-eos", "--max-new-tokens", "5",
                                   "--prompt", "Hello", "--prompt", "world")) == 0
    out, err = capsys.readouterr()
    assert out.count("stopped at --max-new-tokens 5") == 2


# ---- 6. device strings --------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["gpu", "mps", "tpu", "cuda:x", ""])
def test_bad_device_is_one_clear_line(capsys, device):
    with pytest.raises(SystemExit) as exit_info:
        generate.parse_args(["--device", device])
    assert exit_info.value.code == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "--device" in line and "auto, cpu, cuda, cuda:N" in line


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1", "CPU"])
def test_good_devices_parse(device):
    assert generate.parse_args(["--device", device]).device == device.lower()


# ---- 7. engine settings EngineConfig rejects, sampling settings SamplingParams rejects --------------
ENGINE, SAMPLING = "invalid engine configuration: ", "invalid sampling parameters: "


@pytest.mark.parametrize("flags, heading", [
    (["--page-size", "0"], ENGINE), (["--gpu-memory-utilization", "1.5"], ENGINE),
    (["--max-prefill-tokens", "0"], ENGINE), (["--max-model-len", "1"], ENGINE),
    (["--min-p", "2"], SAMPLING), (["--top-k", "-1"], SAMPLING),
], ids=["page-size", "gpu-memory", "prefill", "max-model-len", "min-p", "top-k"])
def test_invalid_setting_is_one_line_before_loading(capsys, monkeypatch, flags, heading):
    def no_model(*args, **kwargs):
        raise AssertionError("the model must not be loaded for an invalid setting")

    monkeypatch.setattr(generate, "LLM", no_model)
    assert generate.main(["--no-drafter", "--prompt", "Hi", *flags]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith("error: " + heading) and flags[0][2:].replace("-", "_") in line
