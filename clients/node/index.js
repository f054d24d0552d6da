'use strict';
// splitserve gRPC client for Node.js: loads protos/pd/v1/router.proto with @grpc/proto-loader (no generated code)
// and streams pd.v1.RouterService/Generate.
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = process.env.SPLITSERVE_PROTOS || path.resolve(__dirname, '..', '..', 'protos');

function loadRouterService(protoRoot = PROTO_ROOT) {
  const definition = protoLoader.loadSync('pd/v1/router.proto', {
    includeDirs: [protoRoot],
    keepCase: true, // field names as in the .proto (max_tokens, token_ids, finish_reason)
    longs: String,
    enums: String, // FinishReason as its name, e.g. "FINISH_REASON_LENGTH"
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).pd.v1.RouterService;
}

class RouterClient {
  /** @param {string} address router gRPC host:port */
  constructor(address, { protoRoot } = {}) {
    const RouterService = loadRouterService(protoRoot);
    this.stub = new RouterService(address, grpc.credentials.createInsecure());
  }

  /**
   * Stream one generation. Yields GenerateResponse objects {request_id, text, token_ids, finish_reason, usage};
   * the last one has finish_reason set and usage. Rejects with a grpc ServiceError (err.code, err.details)
   * on INVALID_ARGUMENT, UNAVAILABLE, ... or when deadlineMs passes.
   * @param {string} prompt
   * `apiKey` is sent as `authorization: Bearer <key>` metadata (a router started with an API key requires it).
   * @param {{max_tokens?: number, temperature?: number, top_p?: number, top_k?: number, seed?: number, stop?: string[], deadlineMs?: number, apiKey?: string}} opts
   */
  async *generate(prompt, opts = {}) {
    const sampling = {
      max_tokens: opts.max_tokens ?? 64,
      temperature: opts.temperature ?? 0,
      top_p: opts.top_p ?? 1,
      top_k: opts.top_k ?? -1,
    };
    if (opts.seed !== undefined) sampling.seed = String(opts.seed);
    const request = { prompt, sampling, stop: opts.stop ?? [] };
    const callOptions = opts.deadlineMs ? { deadline: Date.now() + opts.deadlineMs } : {};
    const metadata = new grpc.Metadata();
    if (opts.apiKey) metadata.set('authorization', `Bearer ${opts.apiKey}`);
    const call = this.stub.Generate(request, metadata, callOptions);
    try {
      for await (const response of call) yield response;
    } finally {
      call.cancel(); // no-op once the stream ended; stops the server's work if the caller broke out early
    }
  }

  close() {
    this.stub.close();
  }
}

module.exports = { RouterClient, loadRouterService, grpc };
