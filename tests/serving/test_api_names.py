"""Names and ids as vLLM's OpenAI server has them: served model names, X-Request-Id,
/tokenize, /detokenize, /version."""

from __future__ import annotations

import importlib.metadata

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
