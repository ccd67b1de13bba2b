// Block keys (docs/spec/block-keys.md, version 2): chained XXH3-64 over
// fixed-size token blocks, seeded by the namespace, each block's bytes followed
// by its extra keys (cache salt, multimodal items; none for a plain text block,
// whose key is then the version-1 one). Keys are unsigned 64-bit integers,
// returned as BigInt: what the uint64/fixed64 fields of the generated messages take.

import { xxh3 } from '@node-rs/xxhash';

const TOKEN_LIMIT = 2 ** 32;

/** Tags of the extra-key items. */
const TAG_SALT = 0x01;
const TAG_MEDIA = 0x02;
const TAG_OTHER = 0x03;

/** An integer offset or length: a safe-integer Number or a BigInt. */
export type Int = number | bigint;

/** A multimodal item as a block sees it: `[identifier, offset]` (offset from the block's first token). */
export type BlockMedia = readonly [identifier: string, offset: Int];

/** A multimodal item of a prompt: `[identifier, offset, length]` of its placeholder tokens. */
export type PromptMedia = readonly [identifier: string, offset: Int, length: Int];

/** Extra keys of a prompt, as the request gives them to the engine. */
export interface BlockKeyOptions {
  /** The request's cache_salt: enters block 0 only, so it scopes the whole chain. */
  cacheSalt?: string;
  /** Each multimodal item, in prompt order. */
  media?: readonly PromptMedia[];
}

/** XXH3-64 (seed 0, default secret) of a byte buffer, as an unsigned BigInt. */
function h(buf: Buffer): bigint {
  return BigInt.asUintN(64, xxh3.xxh64(buf));
}

/** The namespace seed: H(UTF8(model) || 0x00 || UTF8(loraName)). */
export function namespaceSeed(model: string, loraName = ''): bigint {
  return h(Buffer.concat([Buffer.from(model, 'utf8'), Buffer.from([0]), Buffer.from(loraName, 'utf8')]));
}

/** One extra-key item: tag || LE32(data length) || data. */
function item(tag: number, data: Buffer): Buffer {
  const head = Buffer.alloc(5);
  head.writeUInt8(tag, 0);
  head.writeUInt32LE(data.length, 1);
  return Buffer.concat([head, data]);
}

/** An integer offset (Number or BigInt) as a BigInt; throws RangeError otherwise. */
function offsetOf(value: Int, what: string): bigint {
  if (typeof value === 'bigint') return value;
  if (!Number.isSafeInteger(value)) throw new RangeError(`${what}: offset ${value} is not an integer`);
  return BigInt(value);
}

/**
 * E_i of one block (a Buffer, empty when there is nothing): the salt (UTF-8),
 * then each multimodal item `[identifier, offset]` (UTF-8 identifier followed
 * by the offset as LE64 two's complement: the item's first token relative to
 * the block's first, negative when the item began in an earlier block), then
 * each opaque extra.
 */
export function encodeExtras(
  salt = '',
  media: readonly BlockMedia[] = [],
  other: readonly Uint8Array[] = [],
): Buffer {
  const parts: Buffer[] = [];
  if (salt) parts.push(item(TAG_SALT, Buffer.from(salt, 'utf8')));
  media.forEach(([identifier, offset], i) => {
    const off = Buffer.alloc(8);
    off.writeBigUInt64LE(BigInt.asUintN(64, offsetOf(offset, `media[${i}]`)));
    parts.push(item(TAG_MEDIA, Buffer.concat([Buffer.from(identifier, 'utf8'), off])));
  });
  for (const o of other) parts.push(item(TAG_OTHER, Buffer.from(o)));
  return Buffer.concat(parts);
}

/**
 * E_i of each of a prompt's first `nBlocks` blocks, as the engine scopes them:
 * `cacheSalt` enters block 0 only; each item of `media` enters every block its
 * tokens overlap, with its offset relative to that block. null when there is
 * no salt and no item (plain text).
 */
export function promptExtras(
  nBlocks: number,
  blockSize: number,
  cacheSalt = '',
  media: readonly PromptMedia[] = [],
): Buffer[] | null {
  if (!cacheSalt && media.length === 0) return null;
  const items = media.map(
    ([identifier, offset, length], i) =>
      [identifier, offsetOf(offset, `media[${i}]`), offsetOf(length, `media[${i}]`)] as const,
  );
  const out: Buffer[] = [];
  for (let i = 0; i < nBlocks; i++) {
    const start = BigInt(i * blockSize);
    const end = BigInt((i + 1) * blockSize);
    const inBlock = items
      .filter(([, offset, length]) => offset < end && start < offset + length)
      .map(([identifier, offset]): BlockMedia => [identifier, offset - start]);
    out.push(encodeExtras(i === 0 ? cacheSalt : '', inBlock));
  }
  return out;
}

/**
 * The block keys of a prompt: one per full block of `blockSize` tokens (the
 * partial last block gets none). Without `options.cacheSalt` and
 * `options.media` the keys are those of a plain text prompt. Throws RangeError
 * for a token id outside [0, 2^32), naming its index.
 */
export function blockKeys(
  model: string,
  loraName: string,
  tokenIds: readonly number[],
  blockSize: number,
  options: BlockKeyOptions = {},
): bigint[] {
  if (!Number.isInteger(blockSize) || blockSize < 1) {
    throw new RangeError(`blockSize must be a positive integer, got ${blockSize}`);
  }
  const { cacheSalt = '', media = [] } = options;
  const keys: bigint[] = [];
  let prev = namespaceSeed(model, loraName);
  const blocks = Math.floor(tokenIds.length / blockSize);
  const extras = promptExtras(blocks, blockSize, cacheSalt, media);
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
    const extra = extras ? extras[i] : null;
    prev = h(extra && extra.length ? Buffer.concat([payload, extra]) : payload);
    keys.push(prev);
  }
  return keys;
}
