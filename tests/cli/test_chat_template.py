"""A chat template given instead of the model's own (vLLM's --chat-template, `LLM(chat_template=...)`): a file or
its Jinja text, checked before any model loads; chats then go through it in the library, the command line and the
server (whose own process templates them with its copy of the tokenizer)."""

from __future__ import annotations

import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.engine.prompts import chat_template_text
from tests.conftest import build_tiny_model_with_tokenizer
from tests.server_helpers import ProcessServer
from tests.tokenizer_helpers import CHAT_TEMPLATE

# another template than the model would have: the role in brackets
BRACKETS = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory):
    """A tiny model whose tokenizer has no chat template."""
    path = tmp_path_factory.mktemp("no-template")
    build_tiny_model_with_tokenizer(path)
    return path


def test_a_template_is_read_from_a_file_or_taken_as_text(tmp_path):
    file = tmp_path / "template.jinja"
    file.write_text(BRACKETS, encoding="utf-8")
    assert chat_template_text(file) == chat_template_text(str(file)) == chat_template_text(BRACKETS) == BRACKETS


def test_a_template_longer_than_a_file_name_is_taken_as_text_or_read_from_its_file(tmp_path):
    long = BRACKETS + "{# " + "a real template is often thousands of characters long " * 20 + "#}"
    file = tmp_path / "long.jinja"
    file.write_text(long, encoding="utf-8")
    assert chat_template_text(long) == chat_template_text(file) == long


@pytest.mark.parametrize("given, message", [
    ("no/such/template.jinja", "neither a file nor Jinja text"),
    ("{% for m in messages %}{{ m['role'] }}", "does not parse"),
])
def test_a_template_that_is_no_template_is_refused(given, message):
    with pytest.raises(ValueError, match=message):
        chat_template_text(given)


def test_the_library_chats_through_the_given_template(bare_model):
    with pytest.raises(ValueError, match="no chat template"):
        LLM(str(bare_model), device="cpu", num_kv_pages=64, page_size=4).encode("hi", chat=True)
    llm = LLM(str(bare_model), device="cpu", num_kv_pages=64, page_size=4, chat_template=BRACKETS)
    assert llm.encode("hi", chat=True) == llm.tokenizer.encode("[user] hi\n[assistant] ")
    [result] = llm.generate(["hi"], SamplingParams(max_new_tokens=3), chat=True)
    assert result.prompt_token_ids == llm.tokenizer.encode("[user] hi\n[assistant] ")


def test_the_command_line_refuses_a_bad_template_before_loading(capsys):
    from specdec import generate

    assert generate.main(["--target", "/nonexistent/model", "--chat-template", "{% if %}", "--prompt", "x"]) == 2
    assert "chat template" in capsys.readouterr().err


def test_the_server_chats_through_the_given_template(bare_model, tmp_path):
    file = tmp_path / "template.jinja"
    file.write_text(CHAT_TEMPLATE, encoding="utf-8")
    args = ["--target", str(bare_model), "--device", "cpu", "--no-drafter", "--num-kv-pages", "64", "--page-size", "4",
            "--served-model-name", "tiny", "--chat-template", str(file)]
    with ProcessServer(*args) as running:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, temperature=0)
    llm = LLM(str(bare_model), device="cpu", num_kv_pages=64, page_size=4, chat_template=CHAT_TEMPLATE)
    [want] = llm.generate(["hi"], SamplingParams(max_new_tokens=3), chat=True)
    assert answer.usage.prompt_tokens == len(want.prompt_token_ids)
    assert answer.choices[0].message.content == want.text
