'use strict';
// The committed stubs (src/gen/) are what proto/buf.gen.node.yaml generates
// from proto/ now, and the check says so only when they are: a changed, a
// missing and an extra file are each reported. Needs the repository's root
// node_modules (buf, protoc-gen-es: `make setup`).

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { check } = require('../tools/gen-stubs');

const GEN = path.resolve(__dirname, '..', 'src', 'gen');

test('gen: src/gen is what buf.gen.node.yaml generates from proto/', () => {
  assert.deepEqual(check(), [], 'stale stubs: run node tools/gen-stubs.js (or make stubs)');
});

test('gen: the check reports a changed, a missing and an extra file', (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvmesh-node-stale-'));
  t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
  fs.cpSync(GEN, dir, { recursive: true });
  const indexer = path.join(dir, 'kvmesh', 'indexer', 'v1', 'indexer_pb.ts');
  fs.writeFileSync(indexer, fs.readFileSync(indexer, 'utf8').replace('workerId: string;', 'workerId: number;'));
  fs.rmSync(path.join(dir, 'kvmesh', 'tee', 'v1', 'tee_pb.ts'));
  fs.writeFileSync(path.join(dir, 'kvmesh', 'old_pb.ts'), '');
  assert.deepEqual(check(dir), [
    'changed: kvmesh/indexer/v1/indexer_pb.ts',
    'missing: kvmesh/tee/v1/tee_pb.ts',
    'extra: kvmesh/old_pb.ts',
  ]);
});
