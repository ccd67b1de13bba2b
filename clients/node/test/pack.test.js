'use strict';
// The published package: `npm pack` lists the built client and the generated
// stubs (TypeScript sources, JavaScript and declarations) and nothing from
// outside the package (no ../../proto, no .proto file, no tests or tools); and
// the packed tarball, unpacked elsewhere, loads and encodes with nothing but its
// dependencies. Needs dist/ built (`npm run build`, which `npm ci` runs).

const test = require('node:test');
const assert = require('node:assert/strict');
const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');

const PACKAGE = path.resolve(__dirname, '..');
const NPM = process.platform === 'win32' ? 'npm.cmd' : 'npm';
const PROTOS = ['indexer', 'tee', 'xfer'].map((name) => `kvmesh/${name}/v1/${name}_pb`);

/** Files the tarball must hold. */
const REQUIRED = [
  'package.json',
  'README.md',
  'dist/index.js',
  'dist/index.d.ts',
  'dist/client.js',
  'dist/status.js',
  ...PROTOS.flatMap((p) => [`src/gen/${p}.ts`, `dist/gen/${p}.js`, `dist/gen/${p}.d.ts`]),
];

/** What is wrong with a packed file list: required files missing, files from outside the package. */
function packProblems(files) {
  const problems = REQUIRED.filter((f) => !files.includes(f)).map((f) => `missing: ${f}`);
  for (const f of files) {
    const parts = f.split('/');
    if (parts.includes('..') || path.isAbsolute(f)) problems.push(`outside the package: ${f}`);
    else if (f.endsWith('.proto') || parts[0] === 'proto') problems.push(`a proto file: ${f}`);
    else if (['test', 'tools', 'node_modules'].includes(parts[0])) problems.push(`not for publishing: ${f}`);
  }
  return problems;
}

function npm(args, cwd = PACKAGE) {
  return execFileSync(NPM, [...args, '--ignore-scripts', '--json', '--loglevel=error'], { cwd, encoding: 'utf8' });
}

test('pack: the file list holds the generated stubs and nothing from outside the package', () => {
  const [info] = JSON.parse(npm(['pack', '--dry-run']));
  const files = info.files.map((f) => f.path);
  assert.deepEqual(packProblems(files), [], files.join('\n'));
  assert.equal(info.name, '@kvmesh/node-client');
});

test('pack: the check rejects a list with a proto from ../../proto, a test, a missing stub', () => {
  const good = [...REQUIRED];
  assert.deepEqual(packProblems(good), []);
  const bad = [
    ...REQUIRED.filter((f) => f !== 'dist/gen/kvmesh/indexer/v1/indexer_pb.js'),
    '../../proto/kvmesh/indexer/v1/indexer.proto',
    'proto/x.proto',
    'test/pack.test.js',
  ];
  assert.deepEqual(packProblems(bad), [
    'missing: dist/gen/kvmesh/indexer/v1/indexer_pb.js',
    'outside the package: ../../proto/kvmesh/indexer/v1/indexer.proto',
    'a proto file: proto/x.proto',
    'not for publishing: test/pack.test.js',
  ]);
});

test('pack: the tarball, unpacked in another folder, loads and encodes without the repository', (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvmesh-node-pack-'));
  t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
  const [info] = JSON.parse(npm(['pack', '--pack-destination', dir]));
  const home = path.join(dir, 'node_modules', '@kvmesh', 'node-client');
  fs.mkdirSync(home, { recursive: true });
  execFileSync('tar', ['-xzf', path.join(dir, info.filename), '-C', home, '--strip-components=1']);
  assert.ok(!fs.existsSync(path.join(home, 'proto')));
  // Only the package's dependencies are borrowed (NODE_PATH), not its folder in the repository.
  const script = `
    const assert = require('node:assert/strict');
    const client = require('@kvmesh/node-client');
    assert.ok(require.resolve('@kvmesh/node-client').startsWith(${JSON.stringify(home)}));
    const { create, toBinary, fromBinary } = require('@bufbuild/protobuf');
    const keys = client.blockKeys('m', '', Array.from({ length: 32 }, (_, i) => i), 16);
    const req = create(client.MatchRequestSchema, { model: 'm', blockKeys: keys, maxInstances: 2 });
    const back = fromBinary(client.MatchRequestSchema, toBinary(client.MatchRequestSchema, req));
    assert.deepEqual(back.blockKeys, keys);
    assert.deepEqual(client.IndexerService.methods.map((m) => m.name).slice(0, 2), ['RegisterInstance', 'Heartbeat']);
    const xfer = require('@kvmesh/node-client/gen/kvmesh/xfer/v1/xfer_pb');
    assert.equal(xfer.XferService.typeName, 'kvmesh.xfer.v1.XferService');
    const c = client.indexerClient('127.0.0.1:1');
    assert.equal(typeof c.match, 'function');
    c.close();
    console.log('ok');
  `;
  const out = execFileSync(process.execPath, ['-e', script], {
    cwd: dir,
    encoding: 'utf8',
    env: { ...process.env, NODE_PATH: path.join(PACKAGE, 'node_modules') },
  });
  assert.equal(out.trim(), 'ok');
});

module.exports = { packProblems };
