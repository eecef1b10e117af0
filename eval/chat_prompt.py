"""The prompt of every problem set: one user turn through the target's chat template, as token ids."""

from __future__ import annotations


def chat_prompt_ids(tokenizer, user_turn: str, problem_set: str) -> list[int]:
    """Token ids of the chat prompt holding `user_turn`, built here so that the exact prompt is known.

    The message list holds only the user turn, as z-lab does; a template that adds its own default
    system prompt (Qwen2.5) therefore keeps it. Thinking is switched off where the template has the
    switch (Qwen3). `problem_set` names the evaluation in the error about a missing template."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"the target's tokenizer has no chat template; {problem_set} prompts need one")
    options = {"enable_thinking": False} if "enable_thinking" in str(template) else {}
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_turn}], tokenize=False,
                                         add_generation_prompt=True, **options)
    # the template already wrote any BOS / special tokens it wants
    return tokenizer.encode(text, add_special_tokens=False)
