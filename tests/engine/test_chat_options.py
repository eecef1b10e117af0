"""vLLM's chat options (`encode_chat`): no generation prompt, the assistant's last message continued, and more
variables for the template; refused where they cannot apply, naming the option."""

import pytest

from specdec.engine.prompt_encoder import PromptEncoder
from specdec.engine.prompts import encode_chat
from tests.tokenizer_helpers import as_transformers, bytelevel_tokenizer

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
            "<nothink>{% endif %}{% endif %}")
USER = [{"role": "user", "content": "hi"}]
STARTED = USER + [{"role": "assistant", "content": "The answer is"}]


@pytest.fixture(scope="module")
def encoder():
    tokenizer = as_transformers(bytelevel_tokenizer())
    tokenizer.chat_template = TEMPLATE
    return PromptEncoder(tokenizer)


@pytest.mark.parametrize("messages, options, text", [
    (USER, {}, "<user>hi</user><assistant>"),
    (USER, dict(add_generation_prompt=False), "<user>hi</user>"),
    (STARTED, dict(add_generation_prompt=False, continue_final_message=True),
     "<user>hi</user><assistant>The answer is"),
    (USER, dict(template_kwargs={"enable_thinking": False}), "<user>hi</user><assistant><nothink>"),
], ids=["default", "no-generation-prompt", "continued", "template-kwargs"])
def test_options_render_as_the_template_says(encoder, messages, options, text):
    assert encode_chat(encoder, messages, **options) == encoder.tokenizer.encode(text)


@pytest.mark.parametrize("messages, options, option, words", [
    (STARTED, dict(continue_final_message=True), "continue_final_message", "add_generation_prompt false"),
    (USER, dict(add_generation_prompt=False, continue_final_message=True), "continue_final_message", "the user's"),
    (USER, dict(template_kwargs={"tokenize": True, "enable_thinking": False}), "chat_template_kwargs", "tokenize"),
])
def test_options_that_cannot_apply_are_refused_by_name(encoder, messages, options, option, words):
    with pytest.raises(ValueError, match=words) as refused:
        encode_chat(encoder, messages, **options)
    assert refused.value.option == option


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from specdec import LLM
    from tests.conftest import build_tiny_model_with_tokenizer

    path = build_tiny_model_with_tokenizer(tmp_path_factory.mktemp("chat-llm") / "target", chat_template=TEMPLATE)
    return LLM(str(path), None, device="cpu", num_kv_pages=64, page_size=4)


def test_llm_chat_answers_one_conversation_or_several_as_generate_does(llm):
    """`LLM.chat` (vLLM's): conversations through the template with the options given, then `generate`."""
    from specdec import SamplingParams

    params = SamplingParams(max_new_tokens=4)
    options = dict(add_generation_prompt=False, continue_final_message=True)
    [alone] = llm.chat(USER, params)
    several = llm.chat([USER, STARTED], params, chat_template_kwargs={"enable_thinking": False})
    continued = llm.chat(STARTED, params, **options)
    want = llm.generate([llm.encode_chat(USER), llm.encode_chat(USER, chat_template_kwargs={"enable_thinking": False}),
                         llm.encode_chat(STARTED, chat_template_kwargs={"enable_thinking": False}),
                         llm.encode_chat(STARTED, **options)], params)
    got = [alone, *several, *continued]
    assert [r.prompt_token_ids for r in got] == [r.prompt_token_ids for r in want]
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert got[0].prompt_token_ids != got[1].prompt_token_ids  # the template variable reached the template


@pytest.mark.parametrize("messages", [[], ["hi"], [[]], [USER, "hi"]], ids=["empty", "strings", "empty-one", "mixed"])
def test_llm_chat_refuses_what_is_no_conversation(llm, messages):
    with pytest.raises(ValueError, match="conversation"):
        llm.chat(messages)
