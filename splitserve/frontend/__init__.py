"""The front doors (OpenAI-compatible HTTP, gRPC RouterService), independent of where tokens come from.

Modules (import what you need; this package imports nothing eagerly):
    backend      GenerationBackend / TokenEvent / ModelInfo / TokenizerLike interfaces
    pipeline     generate_text(): backend tokens -> TextDelta (n choices demuxed, detokenize, stop strings)
    detokenizer  incremental detokenization (DecodeStream, offset fallback)
    stop         stop-string matching with hold-back
    chat         chat template rendering and encoding
    protocol     OpenAI request/response pydantic models (strict types)
    json_body    request bytes -> JSON object, strictly (UTF-8, no NaN, no duplicate keys or lone surrogates)
    validation   HTTP request body -> validated OpenAI request, or a 400/404/413 APIError
    prepare      request preparation shared by both front doors: prompt -> token ids, checks, SamplingParams
    sampling_map SamplingRequest -> SamplingParams (bad words tokenized vLLM's way; errors name the field)
    prompt_limit refusing a prompt that cannot fit the context before tokenizing it
    offload      worker threads for request preparation (parsing, chat template, tokenization)
    errors       exceptions -> HTTP status + OpenAI error body (the one mapping)
    responses    response objects and stream chunks (n choices, echo, best_of selection)
    logprob_format  OpenAI completions / chat logprob objects, vLLM's prompt_logprobs
    tokenize_api vLLM's /tokenize, /detokenize, /version
    sse          SSE response and client-disconnect handling
    http_app     build_app(): the Starlette app (HTTP front door)
    grpc_api     RouterServicer: the pd.v1.RouterService (gRPC front door)
    testing      test doubles (SimpleTokenizer, SimpleModelInfo, ScriptedBackend)
"""
