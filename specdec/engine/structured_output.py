"""What a request's output must match (vLLM's structured outputs): a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a grammar (llguidance's Lark dialect, or GBNF). Exactly one is set.

    SamplingParams(structured_output=StructuredOutput(json={"type": "object", ...}))

Checked and compiled when made (a bad schema or regex is refused before any work starts, naming what is
wrong); the engine masks the target's logits with it at every verified position (specdec/engine/grammar.py).
Plain data, so that it crosses to the engine's process with the rest of the sampling settings.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import llguidance

MAX_SPEC_CHARS = 1 << 20  # a schema or grammar's text: bounded like a prompt, so one request cannot stall others
MAX_CHOICES = 1024
# compact JSON: no free whitespace between tokens. A grammar that allows any run of whitespace lets a model
# loop on spaces and newlines until max_tokens (a known failure of permissive JSON grammars)
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutput:
    json: dict | str | None = None  # a JSON schema (an object, or its text)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # llguidance's Lark dialect (with %json{...} for embedded schemas) or GBNF

    def __post_init__(self):
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError(f"structured output takes exactly one of json, json_object, regex, choice or grammar; "
                             f"got {', '.join(given) or 'none'}")
        problem = self._type_problem(given[0])
        if problem is None:
            kind, text = self.source
            if len(text) > MAX_SPEC_CHARS:
                problem = f"the {given[0]} is {len(text)} characters; at most {MAX_SPEC_CHARS} are taken"
            else:
                problem = _compile(kind, text)[1]
        if problem:
            raise ValueError(f"invalid structured output ({given[0]}): {problem}")

    def _type_problem(self, name: str) -> str | None:
        value = getattr(self, name)
        if name == "json" and not isinstance(value, (dict, str)):
            return f"json must be a JSON schema (an object or its text), got {type(value).__name__}"
        if name in ("regex", "grammar") and (not isinstance(value, str) or not value):
            return f"{name} must be a non-empty string, got {value!r:.80}"
        if name == "choice" and (not value or len(value) > MAX_CHOICES
                                 or not all(isinstance(c, str) and c for c in value)):
            return f"choice must be 1 to {MAX_CHOICES} non-empty strings, got {value!r:.200}"
        if name == "json_object" and not isinstance(value, bool):
            return f"json_object must be true or false, got {value!r}"
        return None

    @property
    def source(self) -> tuple[str, str]:
        """(kind, text): what is compiled, as text (a schema object as canonical JSON)."""
        if self.json_object:
            return "json", json.dumps({"type": "object"})
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json)  # properties in their order
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return "grammar", self.grammar

    def llguidance_grammar(self) -> str:
        """The compiled grammar llguidance's matcher takes."""
        return _compile(*self.source)[0]


@functools.lru_cache(maxsize=256)
def _compile(kind: str, text: str) -> tuple[str, str]:
    """(llguidance grammar, its problem: "" when it is valid). Cached: n answers and repeated schemas compile
    once."""
    try:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.loads(text), defaults=JSON_OPTIONS)
        elif kind == "choice":
            grammar = llguidance.grammar_from("choice", text)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        else:
            grammar = llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
    except (ValueError, TypeError, RuntimeError) as err:  # json.JSONDecodeError is a ValueError
        return "", str(err)
    return grammar, llguidance.LLMatcher.validate_grammar(grammar).strip()
