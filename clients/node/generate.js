#!/usr/bin/env node
'use strict';
// Stream a completion from a splitserve router over gRPC:
//   node generate.js [--router HOST:PORT] [--max-tokens N] [--temperature T] [--seed S] [--stop STR] [--json] PROMPT
// Prints the text as it arrives (or, with --json, one JSON GenerateResponse per line). Exit 1 with
// "error: CODE: details" on a gRPC error.
const { parseArgs } = require('util');
const { RouterClient, grpc } = require('./index');

async function main() {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      router: { type: 'string', default: process.env.PD_ROUTER_GRPC || '127.0.0.1:50050' },
      'max-tokens': { type: 'string', default: '64' },
      temperature: { type: 'string', default: '0' },
      seed: { type: 'string' },
      stop: { type: 'string', multiple: true, default: [] },
      json: { type: 'boolean', default: false },
      'deadline-ms': { type: 'string', default: '60000' },
    },
  });
  if (positionals.length !== 1) {
    process.stderr.write('usage: node generate.js [--router HOST:PORT] [--max-tokens N] [--json] PROMPT\n');
    return 2;
  }
  const client = new RouterClient(values.router);
  try {
    const stream = client.generate(positionals[0], {
      max_tokens: Number(values['max-tokens']),
      temperature: Number(values.temperature),
      seed: values.seed === undefined ? undefined : Number(values.seed),
      stop: values.stop,
      deadlineMs: Number(values['deadline-ms']),
    });
    for await (const response of stream) {
      process.stdout.write(values.json ? JSON.stringify(response) + '\n' : response.text);
    }
    if (!values.json) process.stdout.write('\n');
    return 0;
  } catch (err) {
    const code = Object.keys(grpc.status).find((name) => grpc.status[name] === err.code) ?? err.code;
    process.stderr.write(`error: ${code}: ${err.details ?? err.message}\n`);
    return 1;
  } finally {
    client.close();
  }
}

main().then((code) => { process.exitCode = code; });
