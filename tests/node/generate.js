#!/usr/bin/env node
// A nanoserve client in another language: proves the public API (generate.proto) is
// usable from any gRPC stack, not only from our generated Python stubs.
//
//   node generate.js HOST:PORT '<GenerateRequest as JSON>'
//
// The request JSON uses the .proto field names (snake_case), e.g.
//   {"token_ids": {"ids": [5, 6, 7]}, "sampling": {"temperature": 0, "max_tokens": 8}}
// It streams Generate and prints one JSON line:
//   {"token_ids": [...], "text": "...", "finish_reason": "FINISH_REASON_LENGTH",
//    "usage": {...}, "num_messages": N, "request_id": "..."}
// On a gRPC error it prints {"error": {"code": 3, "name": "INVALID_ARGUMENT", "details": "..."}}
// and exits with status 1 (so callers can tell an RPC error from a crash, which exits 2).
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = process.env.NANOSERVE_PROTOS || path.join(__dirname, "..", "..", "protos");

function loadGeneration() {
  const definition = protoLoader.loadSync("nanoserve/v1/generate.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true,   // same field names as the .proto and the Python stubs
    enums: String,    // finish_reason as its name, not a bare number
    longs: Number,
    defaults: true,   // unset scalars read as 0 / "" like in Python
    oneofs: true,     // proto3 `optional` fields are synthetic oneofs
  });
  return grpc.loadPackageDefinition(definition).nanoserve.v1.Generation;
}

function statusName(code) {
  return Object.keys(grpc.status).find((k) => grpc.status[k] === code) || String(code);
}

function main() {
  const [target, requestJson] = process.argv.slice(2);
  if (!target || !requestJson) {
    console.error("usage: node generate.js HOST:PORT '<GenerateRequest JSON>'");
    process.exit(2);
  }
  const Generation = loadGeneration();
  const client = new Generation(target, grpc.credentials.createInsecure());
  const deadline = new Date(Date.now() + 60_000);
  const call = client.generate(JSON.parse(requestJson), { deadline });

  const out = { token_ids: [], text: "", finish_reason: null, usage: null, num_messages: 0,
                request_id: "" };
  call.on("data", (msg) => {
    out.num_messages += 1;
    out.request_id = msg.request_id;
    out.token_ids.push(...msg.token_ids);
    out.text += msg.text;
    // Only the last message carries these; earlier ones leave them unset.
    if (msg.finish_reason !== "FINISH_REASON_UNSPECIFIED") out.finish_reason = msg.finish_reason;
    if (msg.usage) out.usage = msg.usage;
  });
  // grpc-js reports a non-OK status as "error" and may still emit "end" after it; on
  // success "status" can come before buffered messages are delivered. So: an error is
  // printed from "status"; a success once both "status" and "end" have been seen.
  let status = null;
  let ended = false;
  let done = false;
  const finish = () => {
    if (done) return;
    if (status && status.code !== grpc.status.OK) {
      console.log(JSON.stringify({ error: { code: status.code, name: statusName(status.code),
                                            details: status.details } }));
      process.exitCode = 1;
    } else if (status && ended) {
      console.log(JSON.stringify(out));
    } else {
      return;
    }
    done = true;
    client.close();
  };
  call.on("error", () => {});  // handled via "status"; without a listener node would throw
  call.on("status", (s) => { status = s; finish(); });
  call.on("end", () => { ended = true; finish(); });
}

// Anything but a clean RPC outcome (bad JSON, a proto-loader error, a bug) exits 2.
process.on("uncaughtException", (err) => {
  console.error(err && err.stack ? err.stack : err);
  process.exit(2);
});

main();
