"""Reasoning apart from content (<think> ... </think>): where an answer starts is read from its prompt, and streamed
pieces add up to the whole answer's split, wherever the pieces break a tag."""

import random

import pytest

from specdec.engine.reasoning import ReasoningText, split_reasoning, starts_in_reasoning

# (answer, whether its prompt left a think block open, its reasoning, its content)
CASES = [
    ("<think>Let me see.</think>\n\nThe answer is 4.", False, "Let me see.", "\n\nThe answer is 4."),
    ("\n <think>x</think>y", False, "x", "y"),
    ("<think></think>Just this.", False, "", "Just this."),
    ("Hello <think>not at the start</think>", False, None, "Hello <think>not at the start</think>"),
    ("No tags at all.", False, None, "No tags at all."),
    ("", False, None, ""),
    ("<thi", False, None, "<thi"),
    ("<think>cut off while thinking", False, "cut off while thinking", ""),
    ("Reasoning from the prompt's block.</think>Answer.", True, "Reasoning from the prompt's block.", "Answer."),
    ("<think>\nopened again</think>Answer.", True, "\nopened again", "Answer."),
    ("cut off, a tag half written </thi", True, "cut off, a tag half written </thi", ""),
    ("two</think>ends</think>", True, "two", "ends</think>"),
]


@pytest.mark.parametrize("answer, opened, reasoning, content", CASES, ids=range(len(CASES)))
def test_whole_answers_split_as_their_prompt_and_tags_say(answer, opened, reasoning, content):
    assert split_reasoning(answer, opened) == (reasoning, content)


@pytest.mark.parametrize("answer, opened, reasoning, content", CASES, ids=range(len(CASES)))
def test_streamed_pieces_add_up_to_the_whole_split(answer, opened, reasoning, content):
    rng = random.Random(7)
    for _ in range(30):
        parser, got = ReasoningText(opened), ["", ""]
        at = 0
        while at < len(answer):
            size = rng.randrange(1, 4)
            for i, piece in enumerate(parser.feed(answer[at:at + size])):
                got[i] += piece
            at += size
        for i, piece in enumerate(parser.finish()):
            got[i] += piece
        assert got == [reasoning or "", content]
        assert parser.thought == (reasoning is not None)


@pytest.mark.parametrize("prompt_tail, opened", [
    ("<|im_start|>assistant\n<think>\n", True),  # DeepSeek-R1's and Qwen3 thinking models' templates
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3's with enable_thinking false
    ("<|im_start|>assistant\n", False),
    ("earlier turn <think>a</think> b <|im_start|>assistant\n", False),
])
def test_the_prompt_says_whether_an_answer_starts_inside_a_think_block(prompt_tail, opened):
    assert starts_in_reasoning(prompt_tail) is opened
