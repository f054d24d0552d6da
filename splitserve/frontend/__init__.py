"""OpenAI-compatible front end, independent of where tokens come from.

Modules (import what you need; this package imports nothing eagerly):
    backend      GenerationBackend / TokenEvent / ModelInfo / TokenizerLike interfaces
    pipeline     generate_text(): backend tokens -> TextDelta (detokenize, stop strings)
    detokenizer  incremental detokenization (DecodeStream, offset fallback)
    stop         stop-string matching with hold-back
    chat         chat template rendering and encoding
    protocol     OpenAI request/response pydantic models
    validation   request body -> validated inputs, or a 400/404 APIError
    errors       exceptions -> HTTP status + OpenAI error body (the one mapping)
    responses    response objects and stream chunks
    sse          SSE response and client-disconnect handling
    http_app     build_app(): the Starlette app
    testing      test doubles (SimpleTokenizer, SimpleModelInfo, ScriptedBackend)
"""
