#!/usr/bin/env node
'use strict';
// The package's generated TypeScript (src/gen/, committed), from proto/ with
// proto/buf.gen.node.yaml and the buf and protoc-gen-es of the repository's
// root node_modules (`make setup`).
//
//   node tools/gen-stubs.js                # regenerate src/gen/
//   node tools/gen-stubs.js --check [dir]  # regenerate into a temporary folder and compare
//                                          # with src/gen/ (or dir); exit 1 listing what differs
//
// Not part of the published package (package.json `files`).

const { spawnSync } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');

const PACKAGE = path.resolve(__dirname, '..');
const REPO = path.resolve(PACKAGE, '..', '..');
const PROTO = path.join(REPO, 'proto');
const BUF = path.join(REPO, 'node_modules', '.bin', 'buf');
const TEMPLATE = 'buf.gen.node.yaml';
/** Where the template writes, below its -o folder. */
const GEN = path.join('src', 'gen');

/** Run the template with -o `out`: the stubs land in `out`/src/gen. */
function generate(out) {
  if (!fs.existsSync(BUF)) throw new Error(`${BUF} is missing: run make setup (or npm ci at the repository root)`);
  const proc = spawnSync(BUF, ['generate', '--template', TEMPLATE, '-o', out], { cwd: PROTO, encoding: 'utf8' });
  if (proc.status !== 0) throw new Error(`buf generate failed (${proc.status}): ${proc.stderr || proc.error}`);
}

/** Relative paths of the files below `dir`, sorted. */
function files(dir) {
  if (!fs.existsSync(dir)) return [];
  return fs
    .readdirSync(dir, { recursive: true, withFileTypes: true })
    .filter((e) => e.isFile())
    .map((e) => path.relative(dir, path.join(e.parentPath || e.path, e.name)).split(path.sep).join('/'))
    .sort();
}

/** What differs between the freshly generated `want` folder and `got`: ['changed: a', 'missing: b', 'extra: c']. */
function differences(want, got) {
  const wantFiles = files(want);
  const gotFiles = new Set(files(got));
  const out = [];
  for (const rel of wantFiles) {
    if (!gotFiles.has(rel)) out.push(`missing: ${rel}`);
    else if (!fs.readFileSync(path.join(want, rel)).equals(fs.readFileSync(path.join(got, rel)))) out.push(`changed: ${rel}`);
    gotFiles.delete(rel);
  }
  for (const rel of gotFiles) out.push(`extra: ${rel}`);
  return out;
}

/** Regenerate into a temporary folder and compare with `dir`; returns the differences. */
function check(dir = path.join(PACKAGE, GEN)) {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'kvmesh-node-gen-'));
  try {
    generate(tmp);
    return differences(path.join(tmp, GEN), dir);
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
}

function main(argv) {
  if (argv[0] === '--check') {
    const dir = argv[1] ? path.resolve(argv[1]) : path.join(PACKAGE, GEN);
    const diff = check(dir);
    if (diff.length) {
      console.error(`${dir} is not what ${TEMPLATE} generates from proto/ (node tools/gen-stubs.js regenerates it):`);
      for (const line of diff) console.error(`  ${line}`);
      return 1;
    }
    console.log(`${dir}: fresh`);
    return 0;
  }
  if (argv.length) {
    console.error('usage: node tools/gen-stubs.js [--check [dir]]');
    return 2;
  }
  generate(PACKAGE);
  console.log(`${path.join(PACKAGE, GEN)}: regenerated`);
  return 0;
}

if (require.main === module) process.exitCode = main(process.argv.slice(2));

module.exports = { check, differences };
