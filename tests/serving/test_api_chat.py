"""`/v1/chat/completions`: template rendering as Hugging Face does, the same prefill path as a
completion, streaming chunks, and errors naming the field."""

from __future__ import annotations

import json

import pytest

from serving.api_chat import CHATML_TEMPLATE, ChatTemplate, load_chat_template
from tests.serving.api_fixtures import make_client

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                         {"type": "text", "text": "there"}]}]
RENDERED = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
            "<|im_start|>assistant\n")


def test_chatml_renders_as_written_by_hand():
    flat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert ChatTemplate(CHATML_TEMPLATE).render(flat, True) == RENDERED
    assert ChatTemplate(CHATML_TEMPLATE).render(flat, False) == RENDERED.removesuffix(
        "<|im_start|>assistant\n")


def test_a_checkpoint_template_is_loaded_and_can_refuse(tmp_path):
    assert load_chat_template(None) == CHATML_TEMPLATE
    tpl = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
           "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "x"},
                           {"name": "default", "template": tpl}]}))
    t = ChatTemplate(load_chat_template(str(tmp_path)))
    assert t.render([{"role": "user", "content": "é"}], True) == '[user]"é"'
    with pytest.raises(ValueError, match="user first"):
        t.render([{"role": "system", "content": "x"}], True)


def test_chat_runs_the_rendered_prompt_and_streams():
    c, _ = make_client()
    with c:
        plain = c.post("/v1/completions", json={"prompt": RENDERED}).json()
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1},
                   headers={"X-Request-Id": "chat-7"})
        body = r.json()
        assert r.status_code == 200 and body["object"] == "chat.completion"
        assert body["id"] == "chatcmpl-chat-7"
        msg = body["choices"][0]["message"]
        assert msg == {"role": "assistant", "content": plain["choices"][0]["text"]}
        assert body["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
        assert body["usage"]["prompt_tokens"] == len(RENDERED.encode())
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True,
                                                 "stream_options": {"include_usage": True}})
        events = [b[len("data: "):] for b in r.text.split("\n\n") if b]
        first, usage = json.loads(events[0]), json.loads(events[1])
        assert first["object"] == "chat.completion.chunk"
        assert first["choices"][0]["delta"]["content"] == msg["content"]
        assert usage["choices"] == [] and events[2] == "[DONE]"


@pytest.mark.parametrize("payload, field", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "other"}, "model"),
])
def test_bad_chat_requests_name_the_field(payload, field):
    c, _ = make_client()
    with c:
        r = c.post("/v1/chat/completions", json=payload)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == field, r.text


def test_a_bad_nested_field_is_named_by_its_path_once():
    # `param` is the top-level field (OpenAI's); the message names the path inside it, with
    # pydantic's union branch tags dropped and each line once.
    c, _ = make_client()
    with c:
        r = c.post("/v1/chat/completions", json={"messages": [{"content": "hi"}]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages"
        assert err["message"] == "messages[0].role: Field required", err
        r = c.post("/v1/completions", json={"prompt": "x", "stop": [1, "a", 2]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "stop"
        assert err["message"] == ("stop: Input should be a valid string; stop[0]: Input should "
                                  "be a valid string; stop[2]: Input should be a valid string")
