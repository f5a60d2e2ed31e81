#!/usr/bin/env bash
# Runs each fuzz target briefly over its committed corpus (needs a nightly toolchain;
# skipped with a message where there is none). FUZZ_SECONDS sets the time per target.
# New inputs go to a scratch directory (libFuzzer writes to the first corpus it is given),
# so a run leaves the committed corpus and the work tree as they were.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "fuzz smoke skipped: no nightly toolchain"
  exit 0
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked -q
fi
seconds=${FUZZ_SECONDS:-20}
for target in frame block_header handshake session; do
  echo "fuzzing $target for ${seconds}s"
  log=$(mktemp)
  found=$(mktemp -d)
  if ! cargo +nightly fuzz run "$target" "$found" "corpus/$target" -- \
      -max_total_time="$seconds" -rss_limit_mb=2048 >"$log" 2>&1; then
    tail -40 "$log"
    echo "fuzz target $target failed: see the crash above and fuzz/artifacts/$target" >&2
    exit 1
  fi
  grep -E "^#[0-9]+ +DONE|^Done [0-9]+ runs" "$log" | tail -1
  rm -rf "$log" "$found"
done
