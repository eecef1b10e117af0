"""What the tests of the eval problem sets and of the benchmark scripts share: a few math500-format
problems, an optional-module check, and a guard that no model is loaded."""

from __future__ import annotations

from eval import command

PROBLEMS = [
    {"problem": "what is 1+1?", "answer": "2", "unique_id": "test/a/1.json", "subject": "a", "level": 1},
    {"problem": "solve x^2 = 4 for x > 0.", "answer": "2", "unique_id": "test/a/2.json", "subject": "a", "level": 2},
    {"problem": "what is 1/2 + 1/2?", "answer": "1", "unique_id": "test/b/3.json", "subject": "b", "level": 1},
]


def importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def refuse_model_loading(monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model must not be loaded before the inputs are checked")

    monkeypatch.setattr(command, "make_llm", no_model)
