"""Command-line arguments shared by every entry point that builds an `LLM` (`specdec generate`, `specdec serve`,
`specdec eval ...`): the model and drafter, and one flag per `EngineConfig` field.

The engine flags are derived from the dataclass itself (name, type, default, and the help and choices of the
field's metadata), so the command line and `EngineConfig` cannot drift apart: a new field is a new flag.
"""

from __future__ import annotations

import argparse
import re
import typing
from dataclasses import Field, fields

from specdec.engine.config import EngineConfig
from specdec.weights.demo_models import DEFAULT_TARGET

VALID_DEVICES = "auto, cpu, cuda, cuda:N"
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every argument's default, unless its help already says what the default is."""

    def _get_help_string(self, action):
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def device_arg(value: str) -> str:
    """--device: auto, cpu, cuda or cuda:N (checked when the arguments are parsed)."""
    device = value.strip().lower()
    if not _DEVICE.fullmatch(device):
        raise argparse.ArgumentTypeError(f"invalid device {value!r}; valid: {VALID_DEVICES}")
    return device


# where a flag parses more leniently than the field accepts: `--device CUDA:0` is read as cuda:0, and a bad
# one is named in one line listing the valid forms (argparse only says "invalid value" of a plain str)
_FLAG_TYPES = {"device": device_arg}


def show_defaults(p: argparse.ArgumentParser) -> None:
    """Show defaults in --help, unless the parser chose a formatter of its own."""
    if p.formatter_class is argparse.HelpFormatter:
        p.formatter_class = DefaultsHelpFormatter


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--target, --drafter, --no-drafter: which models run (`chosen_drafter` reads the drafter back)."""
    show_defaults(p)
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="demo model name, HF model directory, .gguf file or Hugging Face Hub id (org/name)")
    p.add_argument("--revision", default=None, help="with a Hub id --target: its branch, tag or commit")
    p.add_argument("--drafter", default=None, help="DFlash drafter directory (z-lab format), Hub id or shipped name; "
                                                   "None = the target's shipped drafter, if any")
    p.add_argument("--drafter-revision", default=None, help="with a Hub id --drafter: its branch, tag or commit")
    p.add_argument("--no-drafter", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--chat-template", default=None,
                   help="a chat template (a file, or its Jinja text) used instead of the model's own; default: the "
                        "model's")


def flag_name(setting: Field) -> str:
    return "--" + setting.name.replace("_", "-")


def _value_type(hint):
    """The type a flag's text is converted to: `int` for `int` and for `int | None` (None is only a default)."""
    named = [t for t in typing.get_args(hint) if t is not type(None)]
    return named[0] if named else hint


def _flag_options(setting: Field, hint) -> dict:
    """The add_argument keywords of one EngineConfig field."""
    options = {"dest": setting.name, "default": setting.default, "help": setting.metadata.get("help")}
    if hint is bool:  # a switch: --enforce-eager, or --x / --no-x for a field that is on by default
        options["action"] = argparse.BooleanOptionalAction if setting.default else "store_true"
        return options
    options["type"] = _FLAG_TYPES.get(setting.name, _value_type(hint))
    if "choices" in setting.metadata:
        options["choices"] = setting.metadata["choices"]
    return options


def add_engine_arguments(p: argparse.ArgumentParser, aliases: dict[str, list[str]] | None = None) -> None:
    """One flag per EngineConfig field (`engine_options` reads them back). `aliases` gives a field more
    option strings on the same flag, for an entry point that already had a name of its own for it; a caller
    that wants another default than the dataclass's sets it with `p.set_defaults`."""
    show_defaults(p)
    group = p.add_argument_group("engine settings", "one flag per EngineConfig field (specdec/engine/config.py)")
    hints = typing.get_type_hints(EngineConfig)
    for setting in fields(EngineConfig):
        names = [flag_name(setting), *setting.metadata.get("aliases", ()), *(aliases or {}).get(setting.name, [])]
        group.add_argument(*names, **_flag_options(setting, hints[setting.name]))


def engine_options(args: argparse.Namespace) -> dict:
    """The `LLM` keyword arguments (every EngineConfig field) that `add_engine_arguments` collected.
    Raises ValueError, as EngineConfig does, for values it rejects: before any model is loaded."""
    options = {setting.name: getattr(args, setting.name) for setting in fields(EngineConfig)}
    EngineConfig(**options)
    return options


def revisions(args: argparse.Namespace) -> dict:
    """--revision and --drafter-revision as `LLM` keywords."""
    return {"revision": args.revision, "drafter_revision": args.drafter_revision}


def chosen_drafter(args: argparse.Namespace) -> str | None:
    """--drafter, else the target's shipped drafter; None with --no-drafter or when none is shipped."""
    if args.no_drafter:
        return None
    from drafters import DEFAULT_DRAFTERS  # drafters load torch: keep `--help` light

    return args.drafter or DEFAULT_DRAFTERS.get(args.target)
