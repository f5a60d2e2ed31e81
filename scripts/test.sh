#!/usr/bin/env bash
# The whole test suite, as CI runs it: install, format and lint checks, every test.
# Tests needing root and network namespaces run when root (CI is) and skip otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_TERM_COLOR=never

# The interruption and crash tests reserve multi-GiB destination files (two at a time),
# on top of a debug build of the workspace: about 16 GB at the peak. Say so up front,
# so that "No space left on device" from a test is not read as a defect.
need_gb=20
for dir in "${CARGO_TARGET_DIR:-target}" "${TMPDIR:-/tmp}"; do
  mkdir -p "$dir"
  free_gb=$(( $(df --output=avail -k "$dir" | tail -1) / 1048576 ))
  if [ "$free_gb" -lt "$need_gb" ]; then
    echo "warning: $free_gb GB free under $dir; the suite needs about $need_gb GB" >&2
  fi
done

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
