"""/tokenize and /detokenize over the FakeEngine."""

from __future__ import annotations

from fastapi.testclient import TestClient


def test_tokenize_prompt_and_messages(client: TestClient) -> None:
    response = client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True})
    assert response.json() == {"count": 2, "max_model_len": 256, "tokens": [104, 105], "token_strs": ["h", "i"]}
    messages = [{"role": "user", "content": "hi"}]
    response = client.post("/tokenize", json={"messages": messages})
    # Exactly the prompt a chat request would use.
    assert response.json()["tokens"] == list(b"<user>hi\n<assistant>")
    response = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert response.json()["count"] == len("<user>hi\n")


def test_tokenize_errors(client: TestClient) -> None:
    assert client.post("/tokenize", json={}).json()["error"]["param"] == "prompt"
    both = {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}
    assert client.post("/tokenize", json=both).status_code == 400
    assert client.post("/tokenize", json={"prompt": "a", "extra": 1}).json()["error"]["param"] == "extra"


def test_detokenize(client: TestClient) -> None:
    assert client.post("/detokenize", json={"tokens": [104, 105, 256]}).json() == {"prompt": "hi<eos>"}
    response = client.post("/detokenize", json={"tokens": [999]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tokens"
