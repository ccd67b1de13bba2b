'use strict';
// Against a running indexer (KVMESH_INDEXER_ADDR=host:port, block size 16):
// register instances, publish events over PublishEventsStream, Match by token
// ids and by block keys computed here, and check the error contract, all
// through the typed client of the generated stubs (the built package, dist/).
// Skipped when KVMESH_INDEXER_ADDR is not set. Over TLS with the
// KVMESH_CLIENT_* variables (see optionsFromEnv in src/connection.ts); with an
// authorization policy the identity needs the admin role (these tests register
// instances, publish, Match and remove instances).

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const {
  grpc,
  indexerClient,
  optionsFromEnv,
  publishStream,
  errorField,
  blockKeys,
  BatchOutcome,
  Tier,
} = require('..');

const ADDR = process.env.KVMESH_INDEXER_ADDR;
const BLOCK = Number(process.env.KVMESH_INDEXER_BLOCK_SIZE || 16);
// A fresh namespace per run, so a shared indexer's other data cannot interfere.
const MODEL = `node-client/${crypto.randomUUID()}`;
const PROMPT = Array.from({ length: 3 * BLOCK + 5 }, (_, i) => 1000 + i); // 3 blocks + partial
const PROMPT64 = PROMPT.map(BigInt); // token_ids is int64: BigInt in protobuf-es

const opts = { skip: ADDR ? false : 'KVMESH_INDEXER_ADDR is not set' };

function instance(worker) {
  return { workerId: worker, dpRank: 0 };
}

const stored = (value) => ({ kind: { case: 'stored', value } });

test('indexer: register, publish over a stream, match', opts, async (t) => {
  const client = indexerClient(ADDR, optionsFromEnv());
  t.after(() => client.close());
  await client.waitForReady(5000);

  for (const [worker, address] of [['node-a', 'http://a:8000'], ['node-b', 'http://b:8000']]) {
    const res = await client.registerInstance({
      instance: instance(worker),
      model: MODEL,
      address,
      leaseTtlSeconds: 60,
      incarnation: 'run-1',
    });
    assert.equal(res.info.instance.workerId, worker);
    assert.equal(res.info.live, true);
    assert.equal(res.reset, true);
  }

  const keys = blockKeys(MODEL, '', PROMPT, BLOCK);
  assert.equal(keys.length, 3);

  const acks = await publishStream(client, [
    // node-a: all three blocks by token ids; the indexer keys them itself.
    {
      instance: instance('node-a'),
      sequence: 1n,
      events: [
        stored({ blockHashes: [101n, 102n, 103n], tokenIds: PROMPT64.slice(0, 3 * BLOCK), blockSize: BLOCK, tier: Tier.GPU }),
      ],
    },
    // node-b: a token id out of range; rejected in its ack, the stream goes on.
    {
      instance: instance('node-b'),
      sequence: 1n,
      events: [stored({ blockHashes: [201n], tokenIds: [...PROMPT64.slice(0, BLOCK - 1), 2n ** 32n], blockSize: BLOCK })],
    },
    // node-b: the first two blocks by keys computed here, one on CPU.
    {
      instance: instance('node-b'),
      sequence: 2n,
      events: [
        stored({ blockHashes: [201n], blockKeys: keys.slice(0, 1), tier: Tier.GPU }),
        stored({ blockHashes: [202n], parentBlockHash: 201n, blockKeys: keys.slice(1, 2), tier: Tier.CPU }),
      ],
    },
  ]);

  assert.equal(acks.length, 3);
  assert.equal(acks[0].outcome, BatchOutcome.APPLIED);
  assert.equal(acks[0].blocksStored, 3);
  assert.equal(acks[1].outcome, BatchOutcome.REJECTED);
  assert.equal(acks[1].error.code, grpc.status.INVALID_ARGUMENT);
  assert.match(acks[1].error.field, new RegExp(`token_ids\\[${BLOCK - 1}\\]`));
  assert.equal(acks[2].outcome, BatchOutcome.APPLIED);
  assert.equal(acks[2].sequence, 2n);
  assert.equal(acks[2].blocksStored, 2);

  const expected = [
    { worker: 'node-a', address: 'http://a:8000', depth: 3, gpu: 3, cpu: 0 },
    { worker: 'node-b', address: 'http://b:8000', depth: 2, gpu: 1, cpu: 1 },
  ];
  const check = (res) =>
    assert.deepEqual(
      res.matches.map((m) => ({
        worker: m.instance.workerId,
        address: m.address,
        depth: m.depth,
        gpu: m.gpuBlocks,
        cpu: m.cpuBlocks,
      })),
      expected,
    );

  const byTokens = await client.match({ model: MODEL, tokenIds: PROMPT64 });
  assert.equal(byTokens.$typeName, 'kvmesh.indexer.v1.MatchResponse');
  check(byTokens);
  assert.equal(byTokens.totalBlocks, 3);
  assert.equal(byTokens.blockSize, BLOCK);

  const byKeys = await client.match({ model: MODEL, blockKeys: keys });
  check(byKeys);
  assert.equal(byKeys.blockSize, 0);

  // Another namespace (a LoRA adapter) matches nothing.
  const lora = await client.match({ model: MODEL, loraName: 'adapter', tokenIds: PROMPT64 });
  assert.deepEqual(lora.matches, []);

  // maxInstances keeps only the deepest.
  const top = await client.match({ model: MODEL, tokenIds: PROMPT64, maxInstances: 1 });
  assert.deepEqual(top.matches.map((m) => m.instance.workerId), ['node-a']);

  for (const worker of ['node-a', 'node-b']) {
    await client.removeInstance({ instance: instance(worker) });
  }
  const gone = await client.match({ model: MODEL, tokenIds: PROMPT64 });
  assert.deepEqual(gone.matches, []);
});

test('indexer: INVALID_ARGUMENT names the offending field', opts, async (t) => {
  const client = indexerClient(ADDR, optionsFromEnv());
  t.after(() => client.close());

  const tokens = Array.from({ length: BLOCK }, () => 7n);
  tokens[3] = -1n;
  await assert.rejects(client.match({ model: MODEL, tokenIds: tokens }), (err) => {
    assert.equal(err.code, grpc.status.INVALID_ARGUMENT);
    assert.equal(errorField(err), 'token_ids[3]');
    assert.match(err.details, /token_ids\[3\]/);
    return true;
  });

  await assert.rejects(
    client.match({ model: MODEL, tokenIds: tokens.map(() => 1n), blockKeys: [1n] }),
    (err) => {
      assert.equal(err.code, grpc.status.INVALID_ARGUMENT);
      assert.notEqual(errorField(err), '');
      return true;
    },
  );

  await assert.rejects(client.heartbeat({ instance: instance('never-registered') }), (err) => {
    assert.equal(err.code, grpc.status.NOT_FOUND);
    return true;
  });
});
