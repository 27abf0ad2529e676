"""Unexpected failures still answer in the OpenAI error shape, without internals."""

from fastapi import FastAPI
from fastapi.testclient import TestClient

from serve_app.ingress.errors import install_error_handlers


def test_an_unexpected_exception_is_an_openai_shaped_500_without_details():
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internal state /srv/keys")

    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and set(err) == {"message", "type", "param", "code"}
    assert "secret" not in r.text and "RuntimeError" not in r.text
