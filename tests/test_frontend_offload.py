"""Request preparation runs off the event loop, and prompts that cannot fit are refused before tokenizing.

Concurrency is asserted with events (a tokenizer that blocks until the test releases it), never with
wall-clock timings."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import grpc
import httpx
import pytest
from pd.v1 import common_pb2, router_pb2, router_pb2_grpc
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from splitserve.frontend.grpc_api import RouterServicer
from splitserve.frontend.http_app import build_app
from splitserve.frontend.offload import Offload
from splitserve.frontend.prompt_limit import PromptLimit
from splitserve.frontend.testing import ScriptedBackend, SimpleModelInfo, SimpleTokenizer
from splitserve.paths import default_model_path
from splitserve.rpc.server import bind, channel, create_server

TOKENIZER_JSON = str(default_model_path() / "tokenizer.json")
MODEL = "tinystories"
GOOD = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3}
WAIT_S = 30  # upper bound for a wait that must not hang the suite; never reached when the code is right


class RecordingTokenizer(SimpleTokenizer):
    """Records the thread of every ``encode``; ``encode`` of a text of at least ``block_chars`` characters
    signals ``big_started`` and waits for ``release``."""

    def __init__(self, *args, block_chars: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.threads: list[threading.Thread] = []
        self.encoded: list[int] = []  # lengths of the texts encoded
        self.block_chars = block_chars
        self.big_started = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread())
        self.encoded.append(len(text))
        if self.block_chars is not None and len(text) >= self.block_chars:
            self.big_started.set()
            assert self.release.wait(WAIT_S), "the test never released the big prompt"
        return super().encode(text, add_special_tokens)


def recording_tokenizer(**kwargs) -> RecordingTokenizer:
    return RecordingTokenizer(Tokenizer.from_file(TOKENIZER_JSON), bos_token="<|start_story|>", eos_token="<|end_story|>", **kwargs)


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def story(tok) -> list[int]:
    return SimpleTokenizer.encode(tok, " upon a time there was", add_special_tokens=False)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", GOOD),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
])
async def test_tokenization_and_chat_rendering_do_not_run_on_the_event_loop_thread(path, body) -> None:
    tok = recording_tokenizer()
    async with client(build_app(SimpleModelInfo(MODEL, tok, 64), ScriptedBackend(script=story(tok)))) as c:
        loop_thread = threading.current_thread()
        r = await c.post(path, json=body)
    assert r.status_code == 200, r.text
    assert tok.threads and all(t is not loop_thread for t in tok.threads)
    assert all(t.name.startswith("splitserve-prep-small") for t in tok.threads), [t.name for t in tok.threads]


async def test_health_and_a_small_request_complete_while_a_big_prompt_is_tokenized() -> None:
    tok = recording_tokenizer(block_chars=50_000)
    offload = Offload(small_workers=1, large_workers=1, large_bytes=10_000)
    app = build_app(SimpleModelInfo(MODEL, tok, 1_000_000), ScriptedBackend(script=story(tok)), offload=offload)
    async with client(app) as c:
        big = asyncio.create_task(c.post("/v1/completions", json={**GOOD, "prompt": "Once upon a time " * 5_000}))
        assert await asyncio.to_thread(tok.big_started.wait, WAIT_S)  # the big prompt is being tokenized now
        try:
            health = await c.get("/health")
            small = await c.post("/v1/completions", json=GOOD)
            small_chat = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert not big.done()  # all of the above finished while the big prompt was still in the tokenizer
        finally:
            tok.release.set()
        assert health.status_code == 200 and small.status_code == 200 and small_chat.status_code == 200
        r = await big
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 10_000
    big_thread = tok.threads[tok.encoded.index(max(tok.encoded))]
    assert big_thread.name.startswith("splitserve-prep-large")


async def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing() -> None:
    tok = recording_tokenizer()
    async with client(build_app(SimpleModelInfo(MODEL, tok, 512), ScriptedBackend(script=story(tok)))) as c:
        limit = PromptLimit(tok, 512).max_chars
        assert limit == 511 * 72  # the longest TinyStories vocabulary entry is 72 characters
        r = await c.post("/v1/completions", json={**GOOD, "prompt": "x" * (6 * 2**20)})
        chat = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * (limit + 1)}]})
        assert tok.encoded == []  # neither was tokenized
        for resp, param in ((r, "prompt"), (chat, "messages")):
            err = resp.json()["error"]
            assert resp.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == param, err
            assert "maximum context length is 512 tokens" in err["message"]
        just_fits = await c.post("/v1/completions", json={**GOOD, "prompt": "Once upon a time " * 10})
        assert just_fits.status_code == 200 and tok.encoded  # short prompts are tokenized as before


async def test_grpc_prompt_is_tokenized_off_the_event_loop_and_refused_early_when_too_long() -> None:
    tok = recording_tokenizer()
    server, _ = create_server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(RouterServicer(ScriptedBackend(script=story(tok)), tok, 512), server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0)}"
    await server.start()
    try:
        async with channel(address) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            msgs = [m async for m in stub.Generate(router_pb2.GenerateRequest(prompt="Once upon a time",
                                                                             sampling=common_pb2.SamplingParams(max_tokens=2)))]
            assert sum(len(m.token_ids) for m in msgs) == 2
            assert tok.threads and all(t is not threading.current_thread() for t in tok.threads)
            n = len(tok.encoded)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(router_pb2.GenerateRequest(prompt="x" * 2_000_000)):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "maximum context length is 512 tokens" in err.value.details()
            assert len(tok.encoded) == n  # refused without tokenizing
    finally:
        await server.stop(0)


# ------------------------------------------------------------------------------------------- the bound


def _bpe(normalizer=None, pre_tokenizer=None, byte_tokens=False, byte_level=False, **model_kwargs) -> SimpleNamespace:
    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "abab": 4, "\u2581": 5}
    if byte_tokens:
        vocab.update({f"<0x{b:02X}>": 6 + b for b in range(256)})
    if byte_level:
        vocab.update({c: len(vocab) + i for i, c in enumerate(c for c in pre_tokenizers.ByteLevel.alphabet() if c not in vocab)})
    tok = Tokenizer(models.BPE(vocab, [("a", "b"), ("ab", "ab")], **model_kwargs))
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    return SimpleNamespace(hf=tok)


METASPACE = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
# (id, tokenizer, max_chars with max_model_len 11 (10 prompt tokens of at most 5 characters), every character counts)
BOUNDS = [
    ("unk-not-fused", lambda: _bpe(unk_token="<unk>"), 50, True),
    ("byte-fallback-complete", lambda: _bpe(byte_tokens=True, unk_token="<unk>", fuse_unk=True, byte_fallback=True), 60, True),
    ("nfc-composes-up-to-4", lambda: _bpe(normalizers.NFC(), unk_token="<unk>"), 200, True),
    ("byte-level", lambda: _bpe(pre_tokenizer=pre_tokenizers.ByteLevel(), byte_level=True), 50, True),
    ("byte-level-missing-bytes", lambda: _bpe(pre_tokenizer=pre_tokenizers.ByteLevel()), None, None),
    ("split-isolated", lambda: _bpe(pre_tokenizer=pre_tokenizers.Split(" ", "isolated"), unk_token="<unk>"), 50, True),
    ("fused-unk-counts-known-characters", lambda: _bpe(unk_token="<unk>", fuse_unk=True), 50, False),
    ("fused-unk-metaspace", lambda: _bpe(METASPACE, unk_token="<unk>", fuse_unk=True), 50, False),
    ("byte-fallback-incomplete", lambda: _bpe(unk_token="<unk>", fuse_unk=True, byte_fallback=True), 50, False),
    ("fused-unk-nfc", lambda: _bpe(normalizers.NFC(), unk_token="<unk>", fuse_unk=True), None, None),
    ("drops-unknown-characters", lambda: _bpe(), None, None),
    ("strip", lambda: _bpe(normalizers.Strip(), unk_token="<unk>"), None, None),
    ("replace-shrinks", lambda: _bpe(normalizers.Replace("ab", "a"), unk_token="<unk>"), None, None),
    ("whitespace-split", lambda: _bpe(pre_tokenizer=pre_tokenizers.WhitespaceSplit(), unk_token="<unk>"), None, None),
    ("split-removed", lambda: _bpe(pre_tokenizer=pre_tokenizers.Split(" ", "removed"), unk_token="<unk>"), None, None),
    ("wordpiece", lambda: SimpleNamespace(hf=Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))), None, None),
    ("wordlevel", lambda: SimpleNamespace(hf=Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))), None, None),
]


@pytest.mark.parametrize(("make", "max_chars", "count_all"), [b[1:] for b in BOUNDS], ids=[b[0] for b in BOUNDS])
def test_a_bound_only_where_no_character_can_vanish(make, max_chars, count_all) -> None:
    tok = make()
    limit = PromptLimit(tok, 11)
    assert limit.max_chars == max_chars
    if max_chars is None:
        assert limit.fits("ab" * 10_000)
        return
    assert limit.fits("a" * max_chars) and not limit.fits("a" * (max_chars + 1))  # known characters count
    assert limit.fits("\u00e9" * (max_chars + 1)) is (not count_all)  # unknown ones only where each is a token
    for text in ("ab" * 500, "a b " * 500, "\u00e9" * 500, "x y\u00e9" * 300, "\u03c9\u0313\u0301\u0345" * 300):
        if not limit.fits(text):  # refused: then it truly needs more than 10 tokens
            assert len(tok.hf.encode(text).ids) > 10, text[:20]


def test_the_bound_never_refuses_a_prompt_that_fits() -> None:
    """Adversarial texts for the TinyStories tokenizer: a refused text needs more than max_model_len - 1 tokens."""
    tok = SimpleTokenizer.from_file(TOKENIZER_JSON, bos_token="<|start_story|>", eos_token="<|end_story|>")
    vocab = tok.hf.get_vocab(with_added_tokens=True)
    longest = max(vocab, key=len)
    texts = [
        longest.replace("\u2581", " ") * 100, longest * 100, " " * 5000, "\x00" * 5000, "\U0001f600" * 5000, "\u00e9" * 5000,
        "e\u0301" * 3000, "<|start_story|>" * 400, "Once upon a time, there was a little girl named Lily. " * 100,
        "".join(chr(c) for c in range(32, 3000)) * 3, "a\u00e9" * 3000, "\u2581" * 5000,
    ]
    limit = PromptLimit(tok, 64)
    refused = 0
    for text in texts:
        if not limit.fits(text):
            refused += 1
            assert len(tok.encode(text, add_special_tokens=False)) > 63, text[:40]
    assert refused >= 5  # the check does refuse most of them


def test_offload_refuses_empty_pools() -> None:
    with pytest.raises(ValueError):
        Offload(small_workers=0)


def test_a_tokenizer_that_cannot_describe_itself_has_no_bound() -> None:
    class Opaque:
        def to_str(self) -> str:
            raise RuntimeError("no")

    assert PromptLimit(SimpleNamespace(hf=Opaque()), 512).max_chars is None
