"""Answer grading for math500: the last `\\boxed{...}` of a response against the gold `answer`.

Two graders share one interface. `math-verify` (the `eval` extra) parses both sides into sympy and
compares them mathematically; without it, a normalizing string comparison is used (see
`normalize`), which also accepts equal numbers and simple fractions. With math-verify installed an
answer counts as correct when either check accepts it: math-verify cannot parse some plain-text
answers (e.g. a bare choice letter) that the string check matches exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, ClassVar

from eval.problem_set import Graded

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _balanced(text: str, start: int) -> str | None:
    """The text from `start` up to the brace closing an already opened `{`; None if it never closes."""
    depth, i = 1, start
    while i < len(text):
        c = text[i]
        if c == "\\":  # escaped \{ and \} are content, not grouping
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` (or `\\fbox{...}`), nested braces kept; None if none."""
    found = None
    for match in _BOX.finditer(text):
        content = _balanced(text, match.end())
        if content is not None:
            found = content
    return found


def normalize(answer: str) -> str:
    """A canonical string form: formatting that does not change the value is removed.

    Strips `\\text{}`-style wrappers, `\\left`/`\\right`, spacing commands, `$`, `\\%`, degree
    marks, all whitespace and a trailing period; `\\dfrac`/`\\tfrac` become `\\frac`; a lone choice
    letter in parentheses, `(C)`, becomes `C`."""
    s = answer.strip()
    for _ in range(3):  # unwrap nested \text{\textbf{...}}
        s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    s = re.sub(r"\^\{?\\circ\}?", "", s)
    for junk in ("\\!", "\\,", "\\;", "\\:", "\\$", "$", "\\%", "%", "{,}"):
        s = s.replace(junk, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s).rstrip(".")
    return re.sub(r"^\(([A-Za-z])\)$", r"\1", s)


_DECIMAL = r"-?(?:\d+(?:\.\d*)?|\.\d+)"


def as_number(s: str) -> Fraction | None:
    """The exact value of a normalized integer, decimal, `a/b` or `\\frac{a}{b}`; None otherwise."""
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # thousands separators: 1,000
        s = s.replace(",", "")
    frac = re.fullmatch(rf"(-?)\\frac\{{({_DECIMAL})\}}\{{({_DECIMAL})\}}", s) or \
        re.fullmatch(r"(-?)\\frac(\d)(\d)", s)
    if frac:
        sign, num, den = frac.groups()
        return _ratio(num, den, negative=bool(sign))
    slash = re.fullmatch(rf"({_DECIMAL})/({_DECIMAL})", s)
    if slash:
        return _ratio(*slash.groups())
    return Fraction(s) if re.fullmatch(_DECIMAL, s) else None


def _ratio(num: str, den: str, negative: bool = False) -> Fraction | None:
    d = Fraction(den)
    if d == 0:
        return None
    value = Fraction(num) / d
    return -value if negative else value


def strings_match(predicted: str, gold: str) -> bool:
    """The fallback grader: equal after `normalize`, or equal as numbers."""
    a, b = normalize(predicted), normalize(gold)
    if a == b:
        return True
    x, y = as_number(a), as_number(b)
    return x is not None and x == y


def _math_verify_match(predicted: str, gold: str) -> bool:
    from math_verify import parse, verify

    # both sides are boxed contents; re-boxing them lets math-verify's boxed extraction read them whole
    try:
        return bool(verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + predicted + "}")))
    except Exception:  # a parse or timeout failure is an unverified answer, not a crash of the run
        return False


RULES = {
    "math-verify": "last \\boxed{} vs gold: math_verify.verify(parse(gold), parse(pred)), "
                   "or equal after normalize(), or equal as numbers",
    "normalized-string": "last \\boxed{} vs gold: equal after normalize(), or equal as numbers",
}


@dataclass(frozen=True)
class Grader:
    """The math500 grader (`eval.problem_set.Grader`): the last \\boxed{} of a response against `answer`."""

    name: str  # "math-verify" or "normalized-string"; recorded in results.json
    version: str | None
    match: Callable[[str, str], bool]  # (predicted, gold) -> equal
    metric: ClassVar[str] = "accuracy"
    # on the calling thread: math-verify's timeout is a SIGALRM handler, which only the main thread may install
    grading_threads: ClassVar[int | None] = None

    def is_correct(self, predicted: str | None, gold: str) -> bool:
        return predicted is not None and self.match(predicted, gold)

    def grade(self, problem, text: str) -> Graded:
        extracted = last_boxed(text)
        return Graded(extracted, self.is_correct(extracted, problem.answer))

    def describe(self) -> dict:
        return {"name": self.name, "version": self.version, "rule": RULES[self.name]}


def select_grader() -> Grader:
    """math-verify when it is installed, else the normalizing string comparison."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return Grader("normalized-string", None, strings_match)
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("math-verify")
    except PackageNotFoundError:
        found = None
    return Grader("math-verify", found, lambda p, g: strings_match(p, g) or _math_verify_match(p, g))
