'use strict';
// The published declarations type the client: test/typed.ts, compiled against
// dist/*.d.ts, uses the client as documented and marks misuses (a string for a
// BigInt key, a snake_case field, a method the service lacks, a oneof not as
// { case, value }) with @ts-expect-error, each of which tsc requires to be an
// error; a copy without its @ts-expect-error lines must not compile.

const test = require('node:test');
const assert = require('node:assert/strict');
const { spawnSync } = require('node:child_process');
const fs = require('node:fs');
const path = require('node:path');

const TEST = __dirname;
const TSC = path.resolve(TEST, '..', 'node_modules', 'typescript', 'bin', 'tsc');

function tsc(project) {
  return spawnSync(process.execPath, [TSC, '-p', project], { cwd: TEST, encoding: 'utf8' });
}

test('types: the client is typed by the generated messages', (t) => {
  const ok = tsc(path.join(TEST, 'tsconfig.json'));
  assert.equal(ok.status, 0, ok.stdout + ok.stderr);

  // Without the @ts-expect-error markers the misuses are reported.
  const broken = path.join(TEST, 'typed.broken.ts');
  const project = path.join(TEST, 'tsconfig.broken.json');
  t.after(() => {
    fs.rmSync(broken, { force: true });
    fs.rmSync(project, { force: true });
  });
  const source = fs.readFileSync(path.join(TEST, 'typed.ts'), 'utf8');
  const expected = source.split('\n').filter((line) => /^\s*\/\/ @ts-expect-error/.test(line)).length;
  assert.equal(expected, 6);
  fs.writeFileSync(broken, source.replace(/^\s*\/\/ @ts-expect-error.*\n/gm, ''));
  fs.writeFileSync(project, JSON.stringify({ extends: './tsconfig.json', include: ['typed.broken.ts'] }));
  const bad = tsc(project);
  assert.notEqual(bad.status, 0);
  const errors = bad.stdout.split('\n').filter((line) => line.includes('typed.broken.ts') && line.includes('error TS'));
  assert.equal(errors.length, expected, bad.stdout);
});
