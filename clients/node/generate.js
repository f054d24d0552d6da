#!/usr/bin/env node
'use strict';
// Stream a completion from a splitserve router over gRPC:
//   node generate.js [options] PROMPT        (node generate.js --help lists the options)
// Prints the text as it arrives (or, with --json, one JSON GenerateResponse per line). Exit 1 with
// "error: CODE: details" on a gRPC error, 2 on a usage error.
const { parseArgs } = require('util');

const OPTIONS = {
  router: { type: 'string', default: process.env.PD_ROUTER_GRPC || '127.0.0.1:50050' },
  'max-tokens': { type: 'string', default: '64' },
  temperature: { type: 'string', default: '0' },
  seed: { type: 'string' },
  stop: { type: 'string', multiple: true, default: [] },
  json: { type: 'boolean', default: false },
  'deadline-ms': { type: 'string', default: '60000' },
  'api-key': { type: 'string', default: process.env.PD_API_KEY },
  help: { type: 'boolean', short: 'h', default: false },
};

const USAGE_LINE = 'usage: node generate.js [options] PROMPT';
const USAGE = `${USAGE_LINE}

Stream a completion from a splitserve router (pd.v1.RouterService/Generate).

options:
  --router HOST:PORT   router gRPC address; $PD_ROUTER_GRPC when set (default: ${OPTIONS.router.default})
  --max-tokens N       most tokens to generate (default: 64)
  --temperature T      sampling temperature; 0: greedy (default: 0)
  --seed S             sampling seed (default: none)
  --stop STR           stop string; repeat for several (default: none)
  --deadline-ms MS     deadline of the whole call, milliseconds (default: 60000)
  --api-key KEY        router API key, sent as authorization: Bearer KEY (default: $PD_API_KEY; never shown)
  --json               print each GenerateResponse as one JSON line instead of the text
  -h, --help           show this help and exit
`;

function parse(argv) {
  try {
    return parseArgs({ args: argv, allowPositionals: true, options: OPTIONS });
  } catch (err) {
    return { error: err.message };
  }
}

async function main(argv) {
  const { values, positionals, error } = parse(argv);
  if (error === undefined && values.help) {
    process.stdout.write(USAGE);
    return 0;
  }
  if (error !== undefined || positionals.length !== 1) {
    process.stderr.write(`${USAGE_LINE}\nerror: ${error ?? 'expected exactly one PROMPT'} (--help lists the options)\n`);
    return 2;
  }
  let loaded; // @grpc/* only now: --help and usage errors work before `npm ci`
  try {
    loaded = require('./index');
  } catch (err) {
    if (err.code !== 'MODULE_NOT_FOUND') throw err;
    process.stderr.write(`error: ${err.message.split('\n')[0]}: run \`npm ci\` in ${__dirname} first\n`);
    return 1;
  }
  const { RouterClient, grpc } = loaded;
  const client = new RouterClient(values.router);
  try {
    const stream = client.generate(positionals[0], {
      max_tokens: Number(values['max-tokens']),
      temperature: Number(values.temperature),
      seed: values.seed === undefined ? undefined : Number(values.seed),
      stop: values.stop,
      deadlineMs: Number(values['deadline-ms']),
      apiKey: values['api-key'],
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

main(process.argv.slice(2)).then((code) => { process.exitCode = code; });
