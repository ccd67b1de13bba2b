#!/usr/bin/env bash
# buf breaking for proto/: fail when a change breaks the wire or source
# compatibility of the published API (rules: proto/buf.yaml, `breaking: FILE`).
#
# What it compares against, first match wins:
#   1. $BUF_BREAKING_AGAINST, any buf input (e.g. '.git#tag=v0.1.0,subdir=proto').
#   2. On a branch other than main: the main branch, i.e. what the branch would change.
#   3. On main: the newest release tag v*, i.e. the API users have; without one,
#      the previous commit (HEAD~1), i.e. what the last commit changed.
# With no baseline at all (a first commit, a shallow clone) it says so and passes.
set -euo pipefail
cd "$(dirname "$0")/.."
BUF=${BUF:-node_modules/.bin/buf}

against=${BUF_BREAKING_AGAINST:-}
if [[ -z "$against" ]]; then
  branch=$(git rev-parse --abbrev-ref HEAD 2>/dev/null || echo "")
  if [[ "$branch" != "main" ]] && git rev-parse --verify --quiet refs/heads/main >/dev/null; then
    against=".git#branch=main,subdir=proto"
  elif tag=$(git describe --tags --abbrev=0 --match 'v*' 2>/dev/null); then
    against=".git#tag=${tag},subdir=proto"
  elif git rev-parse --verify --quiet 'HEAD~1^{commit}' >/dev/null \
    && git cat-file -e 'HEAD~1:proto/buf.yaml' 2>/dev/null; then
    against=".git#ref=HEAD~1,subdir=proto"
  else
    echo "buf breaking: no baseline (no main branch, release tag or previous commit with proto/); skipped"
    exit 0
  fi
fi
echo "buf breaking: proto against ${against}"
"$BUF" breaking proto --against "$against"
