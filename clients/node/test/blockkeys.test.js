'use strict';
// The block-key test vectors of docs/spec/block-keys.md, computed here with
// XXH3-64 from @node-rs/xxhash: what a router in another language reproduces.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { namespaceSeed, blockKeys } = require('../src');

const VECTORS = path.resolve(__dirname, '..', '..', '..', 'docs', 'spec', 'block-key-vectors.json');
const spec = JSON.parse(fs.readFileSync(VECTORS, 'utf8'));

test('the vector file is version 1 and has cases', () => {
  assert.equal(spec.version, 1);
  assert.ok(spec.vectors.length >= 6);
});

for (const v of spec.vectors) {
  test(`vector: ${v.name}`, () => {
    assert.equal(namespaceSeed(v.model, v.lora_name).toString(), v.namespace_seed);
    const keys = blockKeys(v.model, v.lora_name, v.token_ids, v.block_size);
    assert.deepEqual(
      keys.map((k) => k.toString()),
      v.block_keys,
    );
  });
}

test('a LoRA name changes the seed and every key', () => {
  const tokens = Array.from({ length: 32 }, (_, i) => i);
  const base = blockKeys('m', '', tokens, 16);
  const lora = blockKeys('m', 'a', tokens, 16);
  assert.equal(base.length, 2);
  assert.notEqual(base[0], lora[0]);
  assert.notEqual(base[1], lora[1]);
});

test('keys chain: a different first block changes the second key', () => {
  const a = Array.from({ length: 32 }, (_, i) => i);
  const b = [...a];
  b[0] = 1000;
  assert.notEqual(blockKeys('m', '', a, 16)[1], blockKeys('m', '', b, 16)[1]);
});

test('a token id out of range is refused, naming its index', () => {
  const tokens = Array.from({ length: 16 }, () => 1);
  tokens[5] = 2 ** 32;
  assert.throws(() => blockKeys('m', '', tokens, 16), /token_ids\[5\]/);
  tokens[5] = -1;
  assert.throws(() => blockKeys('m', '', tokens, 16), /token_ids\[5\]/);
});
