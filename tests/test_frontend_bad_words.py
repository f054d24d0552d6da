"""``bad_words`` on a SentencePiece byte-fallback tokenizer (the GGUF model's): the bare piece is banned, not only the
spelling after "▁", over the real colocated engine."""

from __future__ import annotations

import httpx
import pytest

from splitserve.colocated.backend import LocalBackend
from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.frontend.http_app import build_app
from splitserve.frontend.sampling_map import bad_words_token_ids
from splitserve.frontend.testing import SimpleModelInfo
from splitserve.model import load_model
from splitserve.paths import MODELS_DIR


@pytest.fixture(scope="module")
def gguf_lm():
    return load_model(MODELS_DIR / "stories260K.gguf")


def test_a_bad_word_is_banned_bare_and_after_a_space(gguf_lm) -> None:
    tok = gguf_lm.tokenizer
    brace, space = tok.hf.token_to_id("<0x7B>"), tok.hf.token_to_id("▁")
    assert tok.encode("{", add_special_tokens=False) == [space, brace]  # the "▁" prefix the old rule banned only
    assert bad_words_token_ids(tok, ["{"]) == ((brace,), (space, brace))
    dog = bad_words_token_ids(tok, [" dog"])
    assert [[tok.hf.id_to_token(t) for t in w] for w in dog] == [["d", "o", "g"], ["▁do", "g"]]


async def test_bad_words_stop_a_byte_fallback_piece_the_model_is_pushed_to(gguf_lm) -> None:
    tok = gguf_lm.tokenizer
    brace = tok.hf.token_to_id("<0x7B>")
    engine = AsyncEngine(gguf_lm, EngineConfig(kv_cache_mb=4))
    await engine.start()
    app = build_app(SimpleModelInfo("m", tok, engine.max_model_len), LocalBackend(engine))
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "logit_bias": {str(brace): 50},
            "ignore_eos": True}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            pushed = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            banned = await c.post("/v1/completions", json={**body, "bad_words": ["{"]})
    finally:
        await engine.stop()
    assert "{" in pushed  # the bias alone makes the model write "{"
    assert banned.status_code == 200, banned.text
    assert "{" not in banned.json()["choices"][0]["text"]
