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


# apply_chat_template's own arguments: chat_template_kwargs may not set them (they would change what is rendered
# and how, not pass a variable to the template)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatOptionError(ValueError):
    """A chat option that cannot apply to these messages; `option` names it."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


def encode_chat(encoder: PromptEncoder, messages: list[dict], tools: list[dict] | None = None, *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict | None = None) -> list[int]:
    """A conversation through the tokenizer's chat template, with the assistant's generation prompt (and the
    `tools` the model may call, OpenAI's function definitions, which the template renders), into ids by `encoder`
    (which remembers the ids of long pieces it met before: a shared system prompt, earlier turns).

    As vLLM's chat options: `add_generation_prompt=False` leaves the assistant's opening out;
    `continue_final_message=True` renders the last message (the assistant's) open, for the answer to continue it;
    `template_kwargs` are more variables for the template (such as Qwen3's enable_thinking)."""
    tokenizer = encoder.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat=True but this model's tokenizer has no chat template")
    if continue_final_message and add_generation_prompt:
        raise ChatOptionError("continue_final_message", "continue_final_message continues the last message instead of "
                                                        "opening a new one: give add_generation_prompt false with it")
    if continue_final_message and messages[-1].get("role") != "assistant":
        role = messages[-1].get("role")
        raise ChatOptionError("continue_final_message", f"continue_final_message continues the assistant's last "
                                                        f"message, but the last one is the {role}'s")
    extra = dict(template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & extra.keys())
    if reserved:
        raise ChatOptionError("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)}: "
                                                      f"those are options of their own or of the rendering")
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **extra)
    return encoder.encode(text)
