#!/usr/bin/env bash
# The whole test suite, as CI runs it: install, format and lint checks, every test.
# Tests needing root and network namespaces run when root (CI is) and skip otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_TERM_COLOR=never

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test"
cargo test --workspace -- --test-threads=2
echo "== Debian package"
./scripts/test-deb.sh
if [ -x scripts/fuzz-smoke.sh ]; then
  echo "== fuzz smoke"
  ./scripts/fuzz-smoke.sh
fi
