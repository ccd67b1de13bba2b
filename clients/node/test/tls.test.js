'use strict';
// Transport security and identity against running indexers with an
// authorization policy (tests/security/test_node_tls.py starts them):
//   KVMESH_TLS_PKI            folder of ca.crt and <identity>.crt/.key (tests/security/pki.py)
//   KVMESH_TLS_MTLS_ADDR      indexer requiring a client certificate (mutual TLS)
//   KVMESH_TLS_OPTIONAL_ADDR  indexer over TLS where a client certificate is optional
//   KVMESH_TLS_ROUTER_TOKEN   a bearer token the policy grants the router role
// Skipped when KVMESH_TLS_PKI is not set.

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { grpc, connection, indexerClient, BatchOutcome, blockKeys } = require('..');

const PKI = process.env.KVMESH_TLS_PKI;
const MTLS = process.env.KVMESH_TLS_MTLS_ADDR;
const OPTIONAL = process.env.KVMESH_TLS_OPTIONAL_ADDR;
const ROUTER_TOKEN = process.env.KVMESH_TLS_ROUTER_TOKEN;
const BLOCK = Number(process.env.KVMESH_INDEXER_BLOCK_SIZE || 16);
const MODEL = `node-tls/${crypto.randomUUID()}`;
const PROMPT = Array.from({ length: 2 * BLOCK }, (_, i) => 500 + i);
const PROMPT64 = PROMPT.map(BigInt); // token_ids is int64: BigInt in protobuf-es

const opts = { skip: PKI ? false : 'KVMESH_TLS_PKI is not set' };

/** TLS options presenting `identity`'s certificate (null: none). */
function tlsAs(identity, extra = {}) {
  const tls = { caFile: path.join(PKI, 'ca.crt'), ...extra };
  if (identity) {
    tls.certFile = path.join(PKI, `${identity}.crt`);
    tls.keyFile = path.join(PKI, `${identity}.key`);
  }
  return tls;
}

/** A client of `address`; closed when the test ends. */
function clientFor(t, address, options) {
  const client = indexerClient(address, options);
  t.after(() => client.close());
  return client;
}

/** Assert that `promise` rejects with gRPC status `code`. */
async function rejectsWith(promise, code) {
  await assert.rejects(promise, (err) => {
    assert.equal(err.code, code, `expected ${grpc.status[code]}, got ${grpc.status[err.code]}: ${err.details}`);
    return true;
  });
}

const register = (client, worker) =>
  client.registerInstance({
    instance: { workerId: worker, dpRank: 0 },
    model: MODEL,
    address: `http://${worker}:8000`,
    leaseTtlSeconds: 60,
    incarnation: 'run-1',
  });

const publish = (client, worker, sequence) =>
  client.publishEvents({
    batch: {
      instance: { workerId: worker, dpRank: 0 },
      sequence: BigInt(sequence),
      events: [{ kind: { case: 'stored', value: { blockHashes: [1n, 2n], blockKeys: blockKeys(MODEL, '', PROMPT, BLOCK) } } }],
    },
  });

test('tls: the router certificate may Match over mutual TLS', opts, async (t) => {
  const client = clientFor(t, MTLS, { tls: tlsAs('router-a') });
  const res = await client.match({ model: MODEL, tokenIds: PROMPT64 });
  assert.equal(res.totalBlocks, 2);
});

test('tls: without a client certificate the call fails UNAVAILABLE', opts, async (t) => {
  const client = clientFor(t, MTLS, { tls: tlsAs(null) });
  await rejectsWith(client.match({ model: MODEL, tokenIds: PROMPT64 }), grpc.status.UNAVAILABLE);
});

test('tls: an engine publishes for its own instances only', opts, async (t) => {
  const engineA = clientFor(t, MTLS, { tls: tlsAs('engine-a') });
  const engineB = clientFor(t, MTLS, { tls: tlsAs('engine-b') });
  await register(engineB, 'engine-b-0');
  const reg = await register(engineA, 'engine-a-0');
  assert.equal(reg.info.live, true);
  const ack = await publish(engineA, 'engine-a-0', 1);
  assert.equal(ack.ack.outcome, BatchOutcome.APPLIED);
  assert.equal(ack.ack.blocksStored, 2);

  await rejectsWith(register(engineA, 'engine-b-1'), grpc.status.PERMISSION_DENIED);
  await rejectsWith(publish(engineA, 'engine-b-0', 1), grpc.status.PERMISSION_DENIED);
  // An engine may not Match (a router's method).
  await rejectsWith(engineA.match({ model: MODEL, tokenIds: PROMPT64 }), grpc.status.PERMISSION_DENIED);

  // What engine-a published is there for a router.
  const router = clientFor(t, MTLS, { tls: tlsAs('router-a') });
  const res = await router.match({ model: MODEL, tokenIds: PROMPT64 });
  assert.deepEqual(
    res.matches.map((m) => [m.instance.workerId, m.depth]),
    [['engine-a-0', 2]],
  );
});

test('tls: a bearer token over TLS (client certificate optional)', opts, async (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvmesh-node-'));
  t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
  const tokenFile = path.join(dir, 'token');
  fs.writeFileSync(tokenFile, `${ROUTER_TOKEN}\n`);

  const good = clientFor(t, OPTIONAL, { tls: tlsAs(null), tokenFile });
  const res = await good.match({ model: MODEL, tokenIds: PROMPT64 });
  assert.equal(res.totalBlocks, 2);

  const wrong = clientFor(t, OPTIONAL, { tls: tlsAs(null), token: 'not-a-known-token' });
  await rejectsWith(wrong.match({ model: MODEL, tokenIds: PROMPT64 }), grpc.status.UNAUTHENTICATED);

  // The file is read again when it changes.
  fs.writeFileSync(tokenFile, 'rotated-to-an-unknown-token\n');
  await rejectsWith(good.match({ model: MODEL, tokenIds: PROMPT64 }), grpc.status.UNAUTHENTICATED);
});

test('tls: serverName overrides the name the server certificate is checked against', opts, async (t) => {
  // The server certificate names localhost and 127.0.0.1, not kvmesh.invalid.
  const named = clientFor(t, MTLS, { tls: tlsAs('router-a', { serverName: 'localhost' }) });
  await named.match({ model: MODEL, tokenIds: PROMPT64 });
  const wrong = clientFor(t, MTLS, { tls: tlsAs('router-a', { serverName: 'kvmesh.invalid' }) });
  await rejectsWith(wrong.match({ model: MODEL, tokenIds: PROMPT64 }), grpc.status.UNAVAILABLE);
});

test('tls: certificate files watched for rotation (reloadIntervalMs)', opts, async (t) => {
  // The files first hold a router-a certificate from a CA the server does not
  // trust, then the fleet's: new connections present what the files hold then.
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvmesh-node-'));
  t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
  const certFile = path.join(dir, 'tls.crt');
  const keyFile = path.join(dir, 'tls.key');
  const install = (crt, key) => {
    // Each file swapped in one rename, as a Secret update does.
    fs.copyFileSync(crt, `${certFile}.new`);
    fs.copyFileSync(key, `${keyFile}.new`);
    fs.renameSync(`${keyFile}.new`, keyFile);
    fs.renameSync(`${certFile}.new`, certFile);
  };
  install(path.join(PKI, 'rogue', 'router-a.crt'), path.join(PKI, 'rogue', 'router-a.key'));
  const tls = { caFile: path.join(PKI, 'ca.crt'), certFile, keyFile, reloadIntervalMs: 50 };
  const client = clientFor(t, MTLS, { tls });
  const match = () => client.match({ model: MODEL, tokenIds: PROMPT64 }, { deadlineMs: 2000 });
  await rejectsWith(match(), grpc.status.UNAVAILABLE);

  install(path.join(PKI, 'router-a.crt'), path.join(PKI, 'router-a.key'));
  let res = null;
  let last = null;
  // Bounded retries: the channel reconnects with backoff after the refused handshake.
  for (let i = 0; i < 150 && !res; i += 1) {
    try {
      res = await match();
    } catch (err) {
      last = err;
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
  }
  assert.ok(res, `Match never succeeded with the rotated certificate: ${last && last.details}`);
  assert.equal(res.totalBlocks, 2);
});

test('connection: a bearer token is never sent in plaintext', () => {
  assert.throws(() => connection({ token: 'x' }), /needs tls/);
  assert.throws(() => connection({ tls: { certFile: 'a.crt' } }), /needs its key/);
  assert.equal(connection({}).credentials._isSecure(), false);
});
