#!/usr/bin/env bash
# Installs, builds, and runs a loopback demo: a server and a client moving one large file
# and thousands of small files, with the progress bar and a verified summary.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release -q -p wanxfer
BIN=$PWD/target/release/wanxfer

work=$(mktemp -d /tmp/wanxfer-demo.XXXXXX)
server_pid=""
cleanup() {
  local rc=$?
  if [ -n "$server_pid" ]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT INT TERM

echo "generating a dataset: one 1 GiB file and 5,000 files of 64 KiB..."
python3 scripts/gen-dataset.py "$work/src" --large-mib 1024 --small-count 5000 --small-kib 64 --dirs 50
mkdir -p "$work/root"

"$BIN" serve --root "$work/root" --listen 127.0.0.1:0 --secret-file "$work/secret" \
  >"$work/serve.out" 2>"$work/serve.err" &
server_pid=$!
for _ in $(seq 100); do grep -q "serving" "$work/serve.out" 2>/dev/null && break; sleep 0.05; done
addr=$(sed -nE 's/.* on (127\.0\.0\.1:[0-9]+)$/\1/p' "$work/serve.out")
echo "server on $addr serving $work/root"

echo "pushing..."
"$BIN" cp --secret-file "$work/secret" "$work/src" "wanxfer://$addr/dataset"
echo "checking every byte, mode and name against the source..."
diff -r "$work/src" "$work/root/dataset" && echo "verified: destination matches the source"

echo "memory to memory, 8 GiB:"
"$BIN" cp --secret-file "$work/secret" --bytes 8GiB /dev/zero "wanxfer://$addr/dev/null"
