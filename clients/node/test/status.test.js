'use strict';
// The standard error details (google.rpc.Status in grpc-status-details-bin)
// against running indexers: KVMESH_INDEXER_ADDR (block size 16) for a field
// violation, KVMESH_INDEXER_LIMITED_ADDR (an indexer with
// limits.per_client.match_rps 0.001 and match_burst 1) for a retry delay.
// Each test is skipped when its address is not set; TLS and tokens as in
// indexer.test.js (KVMESH_CLIENT_* variables).

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const {
  grpc,
  indexerClient,
  optionsFromEnv,
  errorField,
  STATUS_DETAILS_METADATA,
  richStatus,
  fieldViolations,
  retryDelayMs,
} = require('..');

const ADDR = process.env.KVMESH_INDEXER_ADDR;
const LIMITED = process.env.KVMESH_INDEXER_LIMITED_ADDR;
const BLOCK = Number(process.env.KVMESH_INDEXER_BLOCK_SIZE || 16);
const MODEL = `node-status/${crypto.randomUUID()}`;
// limits.per_client.match_rps of the KVMESH_INDEXER_LIMITED_ADDR indexer: one Match per 1000 s.
const LIMITED_PERIOD_MS = 1000 * 1000;

test(
  'status: INVALID_ARGUMENT carries a google.rpc.BadRequest field violation',
  { skip: ADDR ? false : 'KVMESH_INDEXER_ADDR is not set' },
  async (t) => {
    const client = indexerClient(ADDR, optionsFromEnv());
    t.after(() => client.close());
    const tokens = Array.from({ length: BLOCK }, () => 7n);
    tokens[3] = -1n;
    await assert.rejects(client.match({ model: MODEL, tokenIds: tokens }), (err) => {
      assert.equal(err.code, grpc.status.INVALID_ARGUMENT);
      // The raw trailer is there, as bytes, for any protobuf library to decode.
      const [raw] = err.metadata.get(STATUS_DETAILS_METADATA);
      assert.ok(Buffer.isBuffer(raw) && raw.length > 0);
      const status = richStatus(err);
      assert.equal(status.code, err.code);
      assert.equal(status.message, err.details);
      assert.deepEqual(status.details.map((d) => d.type), ['google.rpc.BadRequest']);
      const [violation] = fieldViolations(err);
      assert.equal(violation.field, 'token_ids[3]');
      assert.equal(violation.field, errorField(err));
      assert.equal(err.details, `${violation.field}: ${violation.description}`);
      assert.equal(retryDelayMs(err), null);
      return true;
    });
  },
);

test(
  'status: a rate refusal carries a google.rpc.RetryInfo delay',
  { skip: LIMITED ? false : 'KVMESH_INDEXER_LIMITED_ADDR is not set' },
  async (t) => {
    const client = indexerClient(LIMITED, optionsFromEnv());
    t.after(() => client.close());
    const request = { model: MODEL, blockKeys: [1n] };
    const started = Date.now();
    // The bucket holds one Match: the first call passes (unless an earlier run spent it).
    let admitted = false;
    let refused = null;
    for (let i = 0; i < 2 && !refused; i += 1) {
      try {
        await client.match(request);
        admitted = true;
      } catch (err) {
        refused = err;
      }
    }
    const elapsed = Date.now() - started;
    assert.ok(refused, 'the second Match was admitted');
    assert.equal(refused.code, grpc.status.RESOURCE_EXHAUSTED, refused.details);
    assert.equal(errorField(refused), 'limits.per_client.match_rps');
    const status = richStatus(refused);
    assert.equal(status.code, refused.code);
    assert.equal(status.message, refused.details);
    assert.deepEqual(status.details.map((d) => d.type), ['google.rpc.RetryInfo']);
    assert.deepEqual(fieldViolations(refused), []);
    const delay = retryDelayMs(refused);
    assert.ok(delay > 0 && delay <= LIMITED_PERIOD_MS, `retry delay ${delay} ms`);
    // A token spent just now refills a whole period later, less the time since.
    if (admitted) assert.ok(delay >= LIMITED_PERIOD_MS - elapsed - 1, `retry delay ${delay} ms`);
  },
);
