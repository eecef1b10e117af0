"""Prompts into token ids: text through the tokenizer (or its chat template), or token ids checked as
such. The library and the server both build their prompts here."""

from __future__ import annotations

import numbers
import os
from pathlib import Path

from specdec.engine.prompt_encoder import PromptEncoder
from specdec.engine.sampling_params import is_int

Prompt = str | list[int]


def prompt_list(prompts) -> list:
    """One prompt (a string or token ids) or several, as a list; numpy arrays and tensors of ids too."""
    if hasattr(prompts, "tolist") and not isinstance(prompts, str):  # numpy array or tensor
        prompts = prompts.tolist()
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and isinstance(prompts[0], numbers.Integral)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; got "
                         f"{type(prompts).__name__}")
    return list(prompts)


def token_ids(prompt) -> list[int]:
    """A prompt given as token ids (a list, numpy array or tensor of integers) -> list[int]."""
    ids = prompt.tolist() if hasattr(prompt, "tolist") else prompt
    if isinstance(ids, (list, tuple)) and all(type(t) is int for t in ids):  # the usual case, without ABC checks
        return list(ids)  # (an ABC check per token cost ~0.5 us: 3 ms of a 6k-token prompt's time to first token)
    if not isinstance(ids, (list, tuple)) or not all(is_int(t) for t in ids):
        raise ValueError(f"a prompt must be a string or a flat list of integer token ids; got {str(prompt)[:80]!r}")
    return [int(t) for t in ids]


def chat_template_text(template: str | os.PathLike) -> str:
    """A chat template given as a file or as its Jinja text (vLLM's --chat-template), checked to parse: its text.
    Raises ValueError naming what is wrong, before any model loads."""
    text = os.fspath(template)
    # Jinja text is taken as it is: a template is often longer than a file name may be (which the OS refuses)
    if "{{" not in text and "{%" not in text:
        try:
            text = Path(text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError, ValueError) as err:  # ValueError: a name with a NUL byte
            raise ValueError(f"the chat template {text[:80]!r} is neither a file nor Jinja text ({{% ... %}}, "
                             f"{{{{ ... }}}}): {err}") from err
    from jinja2.exceptions import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # parsed as transformers renders templates (a sandbox with loop controls)
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as err:
        raise ValueError(f"the chat template does not parse: {err.message} (line {err.lineno})") from err
    return text


def encode_chat(encoder: PromptEncoder, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """A conversation through the tokenizer's chat template, with the assistant's generation prompt (and the
    `tools` the model may call, OpenAI's function definitions, which the template renders), into ids by `encoder`
    (which remembers the ids of long pieces it met before: a shared system prompt, earlier turns)."""
    tokenizer = encoder.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat=True but this model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return encoder.encode(text)
