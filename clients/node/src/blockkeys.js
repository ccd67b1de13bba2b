'use strict';
// Block keys (docs/spec/block-keys.md, version 1): chained XXH3-64 over
// fixed-size token blocks, seeded by the namespace. Keys are unsigned 64-bit
// integers, returned as BigInt.

const { xxh3 } = require('@node-rs/xxhash');

const TOKEN_LIMIT = 2 ** 32;

/** XXH3-64 (seed 0, default secret) of a byte buffer, as an unsigned BigInt. */
function h(buf) {
  return BigInt.asUintN(64, xxh3.xxh64(buf));
}

/** The namespace seed: H(UTF8(model) || 0x00 || UTF8(loraName)). */
function namespaceSeed(model, loraName = '') {
  return h(Buffer.concat([Buffer.from(model, 'utf8'), Buffer.from([0]), Buffer.from(loraName, 'utf8')]));
}

/**
 * The block keys of a prompt: one per full block of `blockSize` tokens (the
 * partial last block gets none). Throws RangeError for a token id outside
 * [0, 2^32), naming its index.
 */
function blockKeys(model, loraName, tokenIds, blockSize) {
  if (!Number.isInteger(blockSize) || blockSize < 1) {
    throw new RangeError(`blockSize must be a positive integer, got ${blockSize}`);
  }
  const keys = [];
  let prev = namespaceSeed(model, loraName);
  const blocks = Math.floor(tokenIds.length / blockSize);
  const payload = Buffer.alloc(8 + 4 * blockSize);
  for (let i = 0; i < blocks; i++) {
    payload.writeBigUInt64LE(prev, 0);
    for (let j = 0; j < blockSize; j++) {
      const idx = i * blockSize + j;
      const t = tokenIds[idx];
      if (!Number.isInteger(t) || t < 0 || t >= TOKEN_LIMIT) {
        throw new RangeError(`token_ids[${idx}]: ${t} is not in [0, 2^32)`);
      }
      payload.writeUInt32LE(t, 8 + 4 * j);
    }
    prev = h(payload);
    keys.push(prev);
  }
  return keys;
}

module.exports = { namespaceSeed, blockKeys };
