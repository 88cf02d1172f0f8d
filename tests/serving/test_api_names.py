"""Names and ids as vLLM's OpenAI server has them: served model names, X-Request-Id,
/tokenize, /detokenize, /version."""

from __future__ import annotations

import importlib.metadata
import json

from fastapi.testclient import TestClient

from serving.api import create_app
from serving.tokenizer import ByteTokenizer
from tests.serving.api_fixtures import make_client


def test_served_model_names_and_request_ids():
    _, engine = make_client()
    app = create_app(engine, tokenizer=ByteTokenizer(256), model_name="tiny", vocab_size=256,
                     served_model_names=["qwen", "alias"])
    with TestClient(app) as client:
        models = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert models == ["qwen", "alias"]
        r = client.post("/v1/completions", json={"prompt": [1, 2]})
        assert r.status_code == 200 and r.json()["model"] == "qwen"
        r = client.post("/v1/completions", json={"prompt": [1, 2], "model": "alias"},
                        headers={"X-Request-Id": "req-42"})
        assert r.json()["model"] == "alias" and r.json()["id"] == "cmpl-req-42"
        assert r.headers["x-request-id"] == "req-42"
        r = client.post("/v1/completions", json={"prompt": [1], "model": "tiny"})
        assert r.status_code == 404 and "'qwen', 'alias'" in r.json()["error"]["message"]
        for bad in ("x" * 129, "has space", "é"):
            r = client.post("/v1/completions", json={"prompt": [1]},
                            headers={"X-Request-Id": bad.encode()})
            assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
        r = client.get("/health", headers={"X-Request-Id": "h-1"})  # echoed on every endpoint
        assert r.headers["x-request-id"] == "h-1"


def test_tokenize_detokenize_version():
    c, engine = make_client()
    with c:
        r = c.post("/tokenize", json={"prompt": "héllo"})
        ids = list("héllo".encode())
        assert r.json() == {"count": len(ids), "max_model_len": engine.max_prompt_len,
                            "tokens": ids}
        assert c.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "héllo"}
        r = c.post("/detokenize", json={"tokens": [1, 256]})
        assert r.status_code == 400 and "tokens[1] = 256" in r.json()["error"]["message"]
        assert c.post("/tokenize", json={"prompt": "a", "model": "nope"}).status_code == 404
        assert c.get("/version").json() == {"version": importlib.metadata.version("vertumnus-jax")}



def test_tokenize_chat_messages_gives_the_chat_prompt():
    from serving.api_chat import CHATML_TEMPLATE
    c, _ = make_client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
            "<|im_start|>assistant\n")  # ChatML by hand (CHATML_TEMPLATE)
    assert "im_start" in CHATML_TEMPLATE
    with c:
        r = c.post("/tokenize", json={"messages": messages})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == list(text.encode())  # the byte tokenizer of the app
        chat = c.post("/v1/chat/completions", json={"messages": messages}).json()
        assert chat["usage"]["prompt_tokens"] == r.json()["count"]  # what a chat prefills
        bare = c.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
        assert bare.json()["tokens"] == list(text.removesuffix("<|im_start|>assistant\n").encode())
        both = c.post("/tokenize", json={"prompt": "a", "messages": messages})
        assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
        bad = c.post("/tokenize", json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def _events(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_stream_sends_the_first_token_then_usage_then_done():
    c, _ = make_client()
    with c:
        plain = c.post("/v1/completions", json={"prompt": [[1, 2], [3, 4, 5]]}).json()
        r = c.post("/v1/completions", json={"prompt": [[1, 2], [3, 4, 5]], "stream": True,
                                            "stream_options": {"include_usage": True}},
                   headers={"X-Request-Id": "s-1"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.text)
        assert events[-1] == "[DONE]" and len(events) == 4
        firsts = [e["choices"][0] for e in events[:2]]
        assert [ch["token_ids"] for ch in firsts] == [ch["token_ids"] for ch in plain["choices"]]
        assert [ch["index"] for ch in firsts] == [0, 1]
        assert all(ch["finish_reason"] == "length" for ch in firsts)
        assert {e["id"] for e in events[:3]} == {"cmpl-s-1"}
        assert events[2]["choices"] == [] and events[2]["usage"]["prompt_tokens"] == 5
        r = c.post("/v1/completions", json={"prompt": [1, 2], "stream": True})
        assert [e if e == "[DONE]" else e["object"] for e in _events(r.text)] == [
            "text_completion", "[DONE]"]  # no usage chunk unless asked
        r = c.post("/v1/completions", json={"prompt": [1, 999], "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # before streaming
