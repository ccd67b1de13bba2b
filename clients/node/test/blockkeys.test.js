'use strict';
// The block-key test vectors of docs/spec/block-keys.md (version 2: with the
// extra keys of salted and multimodal prompts), computed here with XXH3-64 from
// @node-rs/xxhash: what a router in another language reproduces. The file is
// the one tests/unit/test_blockkeys.py checks the Python keys against.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { namespaceSeed, encodeExtras, promptExtras, blockKeys } = require('..');

const VECTORS = path.resolve(__dirname, '..', '..', '..', 'docs', 'spec', 'block-key-vectors.json');
const spec = JSON.parse(fs.readFileSync(VECTORS, 'utf8'));

test('the vector file is version 2 and has cases, salted and multimodal ones among them', () => {
  assert.equal(spec.version, 2);
  assert.ok(spec.vectors.length >= 6);
  for (const v of spec.vectors) {
    assert.equal(typeof v.cache_salt, 'string', v.name);
    assert.ok(Array.isArray(v.media), v.name);
  }
  assert.ok(spec.vectors.some((v) => v.cache_salt && v.media.length));
  assert.ok(spec.vectors.some((v) => v.media.some(([, offset]) => offset % v.block_size !== 0)));
});

/** How the keys computed here differ from vector `v` (empty: they agree). */
function mismatches(v) {
  const problems = [];
  const seed = namespaceSeed(v.model, v.lora_name).toString();
  if (seed !== v.namespace_seed) problems.push(`namespace_seed: ${seed} != ${v.namespace_seed}`);
  const keys = blockKeys(v.model, v.lora_name, v.token_ids, v.block_size, {
    cacheSalt: v.cache_salt,
    media: v.media,
  }).map((k) => k.toString());
  if (keys.length !== v.block_keys.length) problems.push(`${keys.length} keys, the vector has ${v.block_keys.length}`);
  keys.forEach((k, i) => {
    if (i < v.block_keys.length && k !== v.block_keys[i]) problems.push(`block_keys[${i}]: ${k} != ${v.block_keys[i]}`);
  });
  return problems;
}

for (const v of spec.vectors) {
  test(`vector: ${v.name}`, () => {
    assert.deepEqual(mismatches(v), []);
  });
}

test('a wrong vector is rejected: a changed key, a dropped salt, a moved image, another model', () => {
  const salted = spec.vectors.find((v) => v.cache_salt && v.media.length && v.block_keys.length >= 2);
  assert.ok(salted, 'no salted multimodal vector with two keys');
  const last = salted.block_keys.length - 1;
  const changed = [...salted.block_keys];
  changed[last] = (BigInt(changed[last]) ^ 1n).toString();
  assert.deepEqual(mismatches({ ...salted, block_keys: changed }), [
    `block_keys[${last}]: ${salted.block_keys[last]} != ${changed[last]}`,
  ]);
  // Without the salt every key differs (it scopes the whole chain).
  assert.equal(mismatches({ ...salted, cache_salt: '' }).length, salted.block_keys.length);
  // The image one token later: the keys from its first block on differ.
  const [identifier, offset, length] = salted.media[0];
  const moved = { ...salted, media: [[identifier, offset + 1, length], ...salted.media.slice(1)] };
  assert.ok(mismatches(moved).length >= 1);
  // Another model: the seed and every key differ.
  assert.equal(mismatches({ ...salted, model: `${salted.model}-x` }).length, 1 + salted.block_keys.length);
  // The vector lists a key more than the prompt has full blocks.
  assert.deepEqual(mismatches({ ...salted, block_keys: [...salted.block_keys, '1'] }).slice(0, 1), [
    `${salted.block_keys.length} keys, the vector has ${salted.block_keys.length + 1}`,
  ]);
});

test('extra keys: tag, LE32 length, data; an offset is LE64 two\'s complement', () => {
  assert.equal(encodeExtras().length, 0);
  const got = encodeExtras('\u00e9', [['img', -3]], [Buffer.from('pe')]);
  const want = Buffer.concat([
    Buffer.from([0x01, 2, 0, 0, 0, 0xc3, 0xa9]),
    Buffer.from([0x02, 11, 0, 0, 0]),
    Buffer.from('img'),
    Buffer.from([0xfd, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
    Buffer.from([0x03, 2, 0, 0, 0]),
    Buffer.from('pe'),
  ]);
  assert.deepEqual(got, want);
});

test('extra keys: the salt on block 0, an item on every block it overlaps', () => {
  assert.equal(promptExtras(3, 4), null);
  // Blocks of 4; the item's tokens are 2..9: blocks 0, 1 and 2, not 3.
  assert.deepEqual(promptExtras(4, 4, 's', [['x', 2, 8]]), [
    encodeExtras('s', [['x', 2]]),
    encodeExtras('', [['x', -2]]),
    encodeExtras('', [['x', -6]]),
    Buffer.alloc(0),
  ]);
});

test('a plain prompt keeps its version-1 keys; a salt changes every key', () => {
  const tokens = Array.from({ length: 40 }, (_, i) => i);
  const plain = blockKeys('m', '', tokens, 16);
  assert.deepEqual(blockKeys('m', '', tokens, 16, { cacheSalt: '', media: [] }), plain);
  // An item only in the partial last block touches no key.
  assert.deepEqual(blockKeys('m', '', tokens, 16, { media: [['img', 32, 8]] }), plain);
  const a = blockKeys('m', '', tokens, 16, { cacheSalt: 'a' });
  const b = blockKeys('m', '', tokens, 16, { cacheSalt: 'b' });
  for (const k of a) assert.ok(!b.includes(k) && !plain.includes(k));
});

test('moving an image by one token changes the keys from its first block on', () => {
  const tokens = Array.from({ length: 64 }, (_, i) => i % 7);
  const at = (offset) => blockKeys('m', '', tokens, 16, { media: [['img', offset, 10]] });
  const before = at(20);
  const after = at(21);
  assert.equal(before[0], after[0]);
  for (let i = 1; i < 4; i++) assert.notEqual(before[i], after[i]);
});

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
