"""An answer's reasoning apart from its content, for models that think between <think> and </think> (Qwen3,
QwQ, DeepSeek-R1 and its distillations), as vLLM's and SGLang's reasoning parsers give it: a chat answer's
`reasoning_content` beside its `content`.

Where an answer starts is read from its prompt. A template that opens the think block itself (DeepSeek-R1's,
Qwen3 thinking models') leaves the prompt inside it, so the answer starts as reasoning; one that closes an empty
block (Qwen3's with thinking off) or has none leaves it outside, so the answer is content, unless it opens the
block itself at its very start (Qwen3 with thinking on). Reasoning ends at </think>; an answer cut off before it
is all reasoning.

    text = ReasoningText(starts_in_reasoning(prompt_tail))  # one per choice
    reasoning, content = text.feed(piece)   # a tag that may be starting is held back until it is known
    reasoning, content = text.finish()      # at the end: what was held back
"""

from __future__ import annotations

from specdec.engine.tool_calls import partial_tag_length

OPEN, CLOSE = "<think>", "</think>"
# the parsers' names, as vLLM's --reasoning-parser takes them: the models they name think between the same tags
REASONING_PARSERS = ("deepseek_r1", "qwen3")
PROMPT_TAIL_TOKENS = 16  # the prompt's last tokens that show whether it leaves a think block open


def starts_in_reasoning(prompt_tail: str) -> bool:
    """Whether an answer to a prompt ending in `prompt_tail` starts inside a think block the prompt opened."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


class ReasoningText:
    """One answer's text split into reasoning and content as it arrives."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self.thought = in_reasoning  # whether the answer had a think block (its reasoning may be empty)
        self.started = False  # past the answer's start, where a <think> (after whitespace) opens the block
        self.pending = ""  # text not given out yet: the start, or what may be the start of a tag

    def feed(self, text: str) -> tuple[str, str]:
        """New (reasoning, content) text."""
        self.pending += text
        if not self.started and not self._start():
            return "", ""
        if not self.in_reasoning:
            content, self.pending = self.pending, ""
            return "", content
        end = self.pending.find(CLOSE)
        if end >= 0:
            reasoning, content = self.pending[:end], self.pending[end + len(CLOSE):]
            self.in_reasoning, self.pending = False, ""
            return reasoning, content
        keep = partial_tag_length(self.pending, CLOSE)
        reasoning, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """The text held back, as what it turned out to be."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.in_reasoning else ("", rest)

    def _start(self) -> bool:
        """Read the answer's start: a <think> there (after whitespace) opens reasoning and is dropped. Returns False
        while the start may still become that tag."""
        stripped = self.pending.lstrip()
        if stripped.startswith(OPEN):
            self.pending, self.in_reasoning, self.thought = stripped[len(OPEN):], True, True
        elif OPEN.startswith(stripped):
            return False
        self.started = True
        return True


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """A whole answer's reasoning (None: it had none) and content."""
    parser = ReasoningText(in_reasoning)
    reasoning, content = parser.feed(text)
    more_reasoning, more_content = parser.finish()
    return (reasoning + more_reasoning if parser.thought else None), content + more_content
