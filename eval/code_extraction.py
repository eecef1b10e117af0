"""The code in a response to "complete the following Python function", and the module it completes.

The rule, in order:

1. The code is the first fenced block (```python, ```py, or a fence without a language) that
   defines the entry point at the left margin; else the first such block; else, with no fenced
   block at all, the whole response. A block left open (the response was cut off) runs to the end
   of the response.
2. Code that defines the entry point is a whole solution. It goes after the prompt, so the
   prompt's imports and helper functions stay defined and the solution's definition replaces the
   prompt's stub (a signature with its docstring is a complete function). When the code parses,
   only its imports, definitions and assignments are kept: example calls, prints, its own asserts
   and `if __name__ == "__main__":` demos are not part of the function, and a wrong example of
   the model's own must not fail a correct function.
3. Other code is the function's body: it is appended to the prompt, indented by four spaces first
   when its first line has no indentation.
"""

from __future__ import annotations

import ast
import re
import textwrap

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
PYTHON_FENCES = {"", "python", "python3", "py", "py3"}
_KEPT = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)


def python_blocks(text: str) -> list[str]:
    """The contents of the fenced Python (or unlabelled) blocks, in order."""
    return [code for language, code in _FENCE.findall(text) if language.lower() in PYTHON_FENCES]


def defines(code: str, name: str) -> bool:
    """Whether `code` defines function `name` at the left margin (not nested in a class or function)."""
    return re.search(rf"^(?:async[ \t]+)?def[ \t]+{re.escape(name)}[ \t]*\(", code, re.MULTILINE) is not None


def extract_code(text: str, entry_point: str) -> str:
    blocks = python_blocks(text)
    if not blocks:
        return text
    return next((block for block in blocks if defines(block, entry_point)), blocks[0])


def keep_definitions(code: str) -> str:
    """The imports, definitions and assignments at the top level of `code`, verbatim; `code` itself when it
    does not parse (a truncated solution fails on its own)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code
    lines = code.splitlines(keepends=True)
    pieces = []
    for node in tree.body:
        if isinstance(node, _KEPT):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            pieces.append("".join(lines[first - 1:node.end_lineno]).rstrip() + "\n")
    return "\n".join(pieces)


def as_body(code: str) -> str:
    first = next((line for line in code.splitlines() if line.strip()), "")
    return code if first[:1].isspace() else textwrap.indent(code, "    ")


def completed_module(prompt: str, code: str, entry_point: str) -> tuple[str, str]:
    """(the code as it is used, the prompt completed by it) for code extracted from a response."""
    if defines(code, entry_point):
        solution = keep_definitions(code)
        return solution, f"{prompt}\n{solution}"
    body = as_body(code)
    return body, prompt + body
