"""Tool calls parsed out of an answer's text (Hermes format): streamed piece by piece exactly as whole."""

import json
import random

import llguidance
import llguidance.hf
import pytest
from transformers import PreTrainedTokenizerFast

from specdec.engine.tool_calls import OPEN, ToolCallText, forced_calls, split_calls
from tests.tokenizer_helpers import bytelevel_tokenizer

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
TEXTS = [
    "No calls at all, just an answer.",
    CALL,
    "Let me check." + CALL + "\n" + CALL.replace("Oslo", "Rome"),
    "Broken: <tool_call>{not json}</tool_call> and after",
    "Ends inside a tag <tool_c",
    "Unterminated " + CALL[:40],
    "A < sign and <tool_cal> that is no tag",
]


def streamed(text: str, rng: random.Random) -> tuple[str, list]:
    parser, content, calls, at = ToolCallText(), [], [], 0
    while at < len(text):
        step = rng.randint(1, 7)
        piece, found = parser.feed(text[at:at + step])
        content.append(piece)
        calls += found
        at += step
    content.append(parser.finish())
    return "".join(content), calls


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_give_what_the_whole_text_gives(text):
    whole_content, whole_calls = split_calls(text)
    for seed in range(20):
        content, calls = streamed(text, random.Random(seed))
        assert (content.strip() or None) == whole_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_calls_and_content_are_split():
    content, calls = split_calls("Let me check." + CALL + "\n" + CALL.replace("Oslo", "Rome"))
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_weather", {"city": "Rome", "days": 2})]
    assert len({c.id for c in calls}) == 2
    assert split_calls(CALL)[0] is None
    content, calls = split_calls("Broken: <tool_call>{not json}</tool_call>")
    assert not calls and content == "Broken: <tool_call>{not json}</tool_call>"


def test_a_possible_tag_is_held_back_until_known():
    parser = ToolCallText()
    assert parser.feed("Hello <to") == ("Hello ", [])
    assert parser.feed("day") == ("<today", [])
    assert parser.feed(OPEN[:5])[0] == "" and parser.finish() == OPEN[:5]


def test_the_forced_grammar_takes_exactly_calls_of_the_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}}},
             {"type": "function", "function": {"name": "g"}}]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bytelevel_tokenizer(), eos_token="<|endoftext|>")
    llg = llguidance.hf.from_tokenizer(tokenizer)
    grammar = forced_calls(tools, None, parallel=True).llguidance_grammar()

    def takes(text: str) -> bool:
        matcher = llguidance.LLMatcher(llg, grammar)
        return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()

    one = '<tool_call>\n{"name":"f","arguments":{"x":3}}\n</tool_call>\n'
    assert takes(one) and takes(one + '<tool_call>\n{"name":"g","arguments":{}}\n</tool_call>\n')
    assert not takes('<tool_call>\n{"name":"h","arguments":{}}\n</tool_call>\n')  # no such tool
    assert not takes('<tool_call>\n{"name":"f","arguments":{"x":"3"}}\n</tool_call>\n')  # x must be an integer
    assert not takes("Sure! " + one)  # nothing but calls
    named = forced_calls(tools, "g", parallel=False).llguidance_grammar()
    matcher = llguidance.LLMatcher(llg, named)
    assert not matcher.consume_tokens(tokenizer.encode(one))
