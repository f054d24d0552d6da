"""Chat template rendering (Qwen-style template, fallback, BOS handling, template errors)."""

from __future__ import annotations

import pytest

from splitserve.frontend.chat import ChatTemplateError, encode_chat, render_chat
from splitserve.frontend.errors import APIError
from splitserve.frontend.testing import SimpleTokenizer


# The Qwen2.5 chat template (tool-call branches included), as shipped in tokenizer_config.json.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Tell me a story about Lily."},
]


def test_qwen_template_renders_exactly() -> None:
    text = render_chat(MESSAGES, QWEN_TEMPLATE, None, "<|im_end|>")
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nTell me a story about Lily.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen_template_default_system_prompt() -> None:
    text = render_chat([{"role": "user", "content": "日本語?"}], QWEN_TEMPLATE)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert text.endswith("<|im_start|>user\n日本語?<|im_end|>\n<|im_start|>assistant\n")


def test_matches_transformers_apply_chat_template(tok: SimpleTokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}={{ m['content'] | tojson }}\n{% endfor %}"
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf, bos_token=tok.bos_token, eos_token=tok.eos_token)
    for tmpl in (QWEN_TEMPLATE, template):
        ref.chat_template = tmpl
        msgs = [*MESSAGES, {"role": "user", "content": "café ☕ \"quoted\""}]
        want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert render_chat(msgs, tmpl, tok.bos_token, tok.eos_token) == want


def test_fallback_template_when_model_has_none(tok: SimpleTokenizer) -> None:
    text = render_chat(MESSAGES, None)
    assert text == "system: Be brief.\nuser: Hi there\nassistant: Hello!\nuser: Tell me a story about Lily.\nassistant:"
    ids = encode_chat(tok, MESSAGES)
    assert ids == tok.encode(text) and ids[0] == 1 and ids[1] != 1


def test_fallback_template_writes_the_space_only_before_a_letter_or_digit() -> None:
    # an answer comes back with its own first character (" Once", ': "What'): the history renders the prompt + the
    # answer exactly as generated
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Once upon a time"},
                {"role": "user", "content": "\nMore"}, {"role": "assistant", "content": ': "What?"'},
                {"role": "user", "content": "3 cats"}, {"role": "assistant", "content": ""}]
    assert render_chat(messages, None, add_generation_prompt=False) == \
        'user: Hi\nassistant: Once upon a time\nuser:\nMore\nassistant:: "What?"\nuser: 3 cats\nassistant: \n'
    for k in (1, 3):
        prompt = render_chat(messages[:k], None)
        assert render_chat(messages[:k + 2], None).startswith(prompt + messages[k]["content"])


def test_bos_not_added_twice(tok: SimpleTokenizer) -> None:
    tiny_with_bos_template = SimpleTokenizer(
        tok.hf,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    ids = encode_chat(tiny_with_bos_template, [{"role": "user", "content": "Once upon a time"}])
    assert ids.count(1) == 1 and ids[0] == 1
    assert ids == tok.hf.encode("<|start_story|>Once upon a time", add_special_tokens=False).ids


def test_raise_exception_becomes_400() -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    with pytest.raises(APIError) as e:
        render_chat([{"role": "assistant", "content": "x"}], template)
    assert e.value.status == 400 and "first message must be user" in e.value.message
    assert render_chat([{"role": "user", "content": "x"}], template) == "ok"


def test_sandbox_blocks_unsafe_access() -> None:
    with pytest.raises(APIError):
        render_chat(MESSAGES, "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")


def test_broken_template_is_a_server_error() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat(MESSAGES, "{% for m in messages %}")
