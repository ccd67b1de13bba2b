'use strict';
// Against a running indexer (KVMESH_INDEXER_ADDR=host:port, block size 16):
// register instances, publish events over PublishEventsStream, Match by token
// ids and by block keys computed here, and check the error contract.
// Skipped when KVMESH_INDEXER_ADDR is not set. Over TLS with the
// KVMESH_CLIENT_* variables (see optionsFromEnv in src/index.js); with an
// authorization policy the identity needs the admin role (these tests register
// instances, publish, Match and remove instances).

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const {
  grpc,
  indexerClient,
  optionsFromEnv,
  unary,
  publishStream,
  errorField,
  keysToWire,
  blockKeys,
} = require('../src');

const ADDR = process.env.KVMESH_INDEXER_ADDR;
const BLOCK = Number(process.env.KVMESH_INDEXER_BLOCK_SIZE || 16);
// A fresh namespace per run, so a shared indexer's other data cannot interfere.
const MODEL = `node-client/${crypto.randomUUID()}`;
const PROMPT = Array.from({ length: 3 * BLOCK + 5 }, (_, i) => 1000 + i); // 3 blocks + partial

const opts = { skip: ADDR ? false : 'KVMESH_INDEXER_ADDR is not set' };

function instance(worker) {
  return { worker_id: worker, dp_rank: 0 };
}

test('indexer: register, publish over a stream, match', opts, async (t) => {
  const client = indexerClient(ADDR, optionsFromEnv());
  t.after(() => client.close());
  await new Promise((resolve, reject) =>
    client.waitForReady(Date.now() + 5000, (err) => (err ? reject(err) : resolve())),
  );

  for (const [worker, address] of [['node-a', 'http://a:8000'], ['node-b', 'http://b:8000']]) {
    const res = await unary(client, 'RegisterInstance', {
      instance: instance(worker),
      model: MODEL,
      address,
      lease_ttl_seconds: 60,
      incarnation: 'run-1',
    });
    assert.equal(res.info.instance.worker_id, worker);
    assert.equal(res.info.live, true);
    assert.equal(res.reset, true);
  }

  const keys = blockKeys(MODEL, '', PROMPT, BLOCK);
  assert.equal(keys.length, 3);

  const acks = await publishStream(client, [
    // node-a: all three blocks by token ids; the indexer keys them itself.
    {
      instance: instance('node-a'),
      sequence: '1',
      events: [
        {
          stored: {
            block_hashes: ['101', '102', '103'],
            token_ids: PROMPT.slice(0, 3 * BLOCK),
            block_size: BLOCK,
            tier: 'TIER_GPU',
          },
        },
      ],
    },
    // node-b: a token id out of range; rejected in its ack, the stream goes on.
    {
      instance: instance('node-b'),
      sequence: '1',
      events: [
        {
          stored: {
            block_hashes: ['201'],
            token_ids: [...PROMPT.slice(0, BLOCK - 1), 2 ** 32],
            block_size: BLOCK,
          },
        },
      ],
    },
    // node-b: the first two blocks by keys computed here, one on CPU.
    {
      instance: instance('node-b'),
      sequence: '2',
      events: [
        { stored: { block_hashes: ['201'], block_keys: keysToWire(keys.slice(0, 1)), tier: 'TIER_GPU' } },
        {
          stored: {
            block_hashes: ['202'],
            parent_block_hash: '201',
            block_keys: keysToWire(keys.slice(1, 2)),
            tier: 'TIER_CPU',
          },
        },
      ],
    },
  ]);

  assert.equal(acks.length, 3);
  assert.equal(acks[0].outcome, 'BATCH_OUTCOME_APPLIED');
  assert.equal(acks[0].blocks_stored, 3);
  assert.equal(acks[1].outcome, 'BATCH_OUTCOME_REJECTED');
  assert.equal(acks[1].error.code, grpc.status.INVALID_ARGUMENT);
  assert.match(acks[1].error.field, new RegExp(`token_ids\\[${BLOCK - 1}\\]`));
  assert.equal(acks[2].outcome, 'BATCH_OUTCOME_APPLIED');
  assert.equal(acks[2].sequence, '2');
  assert.equal(acks[2].blocks_stored, 2);

  const expected = [
    { worker: 'node-a', address: 'http://a:8000', depth: 3, gpu: 3, cpu: 0 },
    { worker: 'node-b', address: 'http://b:8000', depth: 2, gpu: 1, cpu: 1 },
  ];
  const check = (res) =>
    assert.deepEqual(
      res.matches.map((m) => ({
        worker: m.instance.worker_id,
        address: m.address,
        depth: m.depth,
        gpu: m.gpu_blocks,
        cpu: m.cpu_blocks,
      })),
      expected,
    );

  const byTokens = await unary(client, 'Match', { model: MODEL, token_ids: PROMPT });
  check(byTokens);
  assert.equal(byTokens.total_blocks, 3);
  assert.equal(byTokens.block_size, BLOCK);

  const byKeys = await unary(client, 'Match', { model: MODEL, block_keys: keysToWire(keys) });
  check(byKeys);
  assert.equal(byKeys.block_size, 0);

  // Another namespace (a LoRA adapter) matches nothing.
  const lora = await unary(client, 'Match', { model: MODEL, lora_name: 'adapter', token_ids: PROMPT });
  assert.deepEqual(lora.matches, []);

  // max_instances keeps only the deepest.
  const top = await unary(client, 'Match', { model: MODEL, token_ids: PROMPT, max_instances: 1 });
  assert.deepEqual(top.matches.map((m) => m.instance.worker_id), ['node-a']);

  for (const worker of ['node-a', 'node-b']) {
    await unary(client, 'RemoveInstance', { instance: instance(worker) });
  }
  const gone = await unary(client, 'Match', { model: MODEL, token_ids: PROMPT });
  assert.deepEqual(gone.matches, []);
});

test('indexer: INVALID_ARGUMENT names the offending field', opts, async (t) => {
  const client = indexerClient(ADDR, optionsFromEnv());
  t.after(() => client.close());

  const tokens = Array.from({ length: BLOCK }, () => 7);
  tokens[3] = -1;
  await assert.rejects(unary(client, 'Match', { model: MODEL, token_ids: tokens }), (err) => {
    assert.equal(err.code, grpc.status.INVALID_ARGUMENT);
    assert.equal(errorField(err), 'token_ids[3]');
    assert.match(err.details, /token_ids\[3\]/);
    return true;
  });

  await assert.rejects(
    unary(client, 'Match', { model: MODEL, token_ids: tokens.map(() => 1), block_keys: ['1'] }),
    (err) => {
      assert.equal(err.code, grpc.status.INVALID_ARGUMENT);
      assert.notEqual(errorField(err), '');
      return true;
    },
  );

  await assert.rejects(unary(client, 'Heartbeat', { instance: instance('never-registered') }), (err) => {
    assert.equal(err.code, grpc.status.NOT_FOUND);
    return true;
  });
});
