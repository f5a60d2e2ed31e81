#!/usr/bin/env bash
# One command: install the peer tools (Debian 12, bench-only packages), build wanxfer and
# run the side-by-side benchmark. Results land in bench/runs/peers-<date>[-quick].{md,json}.
#
#   bench/run-peers.sh            # --quick: small sizes, ~2 minute smoke test
#   bench/run-peers.sh --full     # the issue's sizes (needs ~9 GiB free in /dev/shm)
#   bench/run-peers.sh --full --only wanxfer,rsync --workloads small4
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-bench-deps.sh
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
cargo build --release -q -p wanxfer
exec python3 bench/peers.py "$@"
