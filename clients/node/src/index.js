'use strict';
// A small Node.js client of the kvmesh indexer. The service definitions are
// loaded from proto/ at run time (@grpc/proto-loader), so there is no
// generated code to keep fresh: the .proto files are the contract.

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { namespaceSeed, blockKeys } = require('./blockkeys');

/** The repository's proto/ directory (the import root of every kvmesh proto). */
const PROTO_ROOT = path.resolve(__dirname, '..', '..', '..', 'proto');

/** Trailing metadata key naming the offending field of an INVALID_ARGUMENT. */
const ERROR_FIELD_METADATA = 'kvmesh-error-field';

const LOADER_OPTIONS = {
  keepCase: true, // field names as in the proto: worker_id, block_keys, ...
  longs: String, // 64-bit integers as decimal strings (exact; JS numbers are not)
  enums: String, // enum values by name: TIER_GPU, BATCH_OUTCOME_APPLIED, ...
  defaults: true, // zero values present (depth 0, stale false)
  oneofs: true, // Event.kind names the set member
  includeDirs: [PROTO_ROOT],
};

/** Load one kvmesh proto file, e.g. 'kvmesh/indexer/v1/indexer.proto'. */
function loadProto(file) {
  return grpc.loadPackageDefinition(protoLoader.loadSync(file, LOADER_OPTIONS));
}

/** An IndexerService client for `address` (host:port), over plaintext. */
function indexerClient(address, options = {}) {
  const pkg = loadProto('kvmesh/indexer/v1/indexer.proto');
  return new pkg.kvmesh.indexer.v1.IndexerService(address, grpc.credentials.createInsecure(), options);
}

/** Call a unary method as a Promise; `deadlineMs` bounds it. */
function unary(client, method, request, deadlineMs = 5000) {
  return new Promise((resolve, reject) => {
    client[method](request, { deadline: Date.now() + deadlineMs }, (err, res) => (err ? reject(err) : resolve(res)));
  });
}

/**
 * Publish batches over PublishEventsStream, in order, and resolve with one
 * ack per batch (a rejected batch is reported in its ack; the stream goes on).
 */
function publishStream(client, batches, deadlineMs = 10000) {
  return new Promise((resolve, reject) => {
    const acks = [];
    const call = client.PublishEventsStream({ deadline: Date.now() + deadlineMs });
    call.on('data', (res) => acks.push(res.ack));
    call.on('error', reject);
    call.on('end', () => resolve(acks));
    for (const batch of batches) call.write({ batch });
    call.end();
  });
}

/** The field an error names (trailing metadata), or '' when it names none. */
function errorField(err) {
  const values = err && err.metadata ? err.metadata.get(ERROR_FIELD_METADATA) : [];
  return values.length ? String(values[0]) : '';
}

/** Unsigned 64-bit keys (BigInt) as the decimal strings the loader sends exactly. */
function keysToWire(keys) {
  return keys.map((k) => BigInt.asUintN(64, BigInt(k)).toString());
}

module.exports = {
  PROTO_ROOT,
  ERROR_FIELD_METADATA,
  grpc,
  loadProto,
  indexerClient,
  unary,
  publishStream,
  errorField,
  keysToWire,
  namespaceSeed,
  blockKeys,
};
