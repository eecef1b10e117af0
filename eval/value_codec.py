"""Plain values to a line of JSON and back, for calls between a sandboxed program and the grader.

What a test hands a function and gets back: numbers (nan and infinities too; numpy's scalars and other
number types as the plain number they equal), strings, bytes, booleans, None, and lists, tuples, sets
and dicts of them, each keeping its type (a tuple stays a tuple). Nothing
else crosses: decoding builds only these types, so the grader never runs or unpickles anything the
sandboxed program wrote. Standard library only (the sandbox side imports it by path).
"""

from __future__ import annotations

import json
import math
import numbers

MAX_LINE_CHARS = 16 << 20  # a reply longer than this is refused: one answer must not exhaust the grader


class Unrepresentable(ValueError):
    pass


def encode(value) -> str:
    return json.dumps(_plain(value), separators=(",", ":"))


def decode(line: str):
    if len(line) > MAX_LINE_CHARS:
        raise Unrepresentable(f"a value of {len(line)} characters is over the limit of {MAX_LINE_CHARS}")
    return _value(json.loads(line))


def _plain(value):
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    # other numbers as the plain ones they equal (numpy's scalars, Fraction, Decimal): a test compares values
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        return _plain(value.item())
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return _plain(float(value))
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v) for v in value]
        return items if type(value) is list else {type(value).__name__: items}
    if isinstance(value, dict):
        return {"dict": [[_plain(k), _plain(v)] for k, v in value.items()]}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, complex):
        return {"complex": [_plain(value.real), _plain(value.imag)]}
    raise Unrepresentable(f"a value of type {type(value).__name__} cannot cross the sandbox")


def _value(plain):
    if plain is None or isinstance(plain, (bool, int, float, str)):
        return plain
    if isinstance(plain, list):
        return [_value(v) for v in plain]
    if isinstance(plain, dict) and len(plain) == 1:
        (kind, body), = plain.items()
        if kind == "float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if kind in ("tuple", "set", "frozenset") and isinstance(body, list):
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[kind](_value(v) for v in body)
        if kind == "dict" and isinstance(body, list):
            return {_value(k): _value(v) for k, v in body}
        if kind == "bytes" and isinstance(body, str):
            return bytes.fromhex(body)
        if kind == "complex" and isinstance(body, list) and len(body) == 2:
            return complex(_value(body[0]), _value(body[1]))
    raise Unrepresentable(f"not an encoded value: {str(plain)[:80]}")
