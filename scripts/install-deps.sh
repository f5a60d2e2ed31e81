#!/usr/bin/env bash
# Installs what building and testing wanxfer needs on a fresh Debian 12 machine.
# Idempotent: packages already present are skipped, so repeated runs cost seconds.
set -euo pipefail

PACKAGES=(
  build-essential pkg-config      # C toolchain for the libfabric bindings
  libfabric-dev libfabric-bin     # RDMA through libfabric (tcp provider on machines without RDMA)
  libclang-dev                    # bindgen, for the libfabric bindings
  iproute2                        # network namespaces for the WAN emulator tests
  iperf3                          # the ceiling in benchmarks; traffic in the emulator tests
  iputils-ping                    # delay checks through the WAN emulator
  python3                         # benchmark drivers; zlib.adler32 in the ops tests
  systemd                         # the package test: systemd-analyze, -sysusers, -tmpfiles
  xxhash                          # xxhsum -H2, the reference for `wanxfer sum`
  libgfal2-dev                    # the gfal2 plugin's headers (bindgen) and libraries
  gfal2 python3-gfal2             # gfal2 with its plugins, and the Python bindings its tests drive
  python3-prometheus-client       # Prometheus's own parsers read the metrics endpoint (tests/metrics.rs)
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Rust: Debian 12's own rustc (1.63) is too old; the rustup toolchain is used when present.
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo not found: install a Rust toolchain >= 1.85 (rustup), then re-run" >&2
  exit 1
fi
rustc_minor=$(rustc --version | sed -E 's/rustc 1\.([0-9]+).*/\1/')
if [ "$rustc_minor" -lt 85 ]; then
  echo "rustc $(rustc --version) is too old: wanxfer needs 1.85 or newer" >&2
  exit 1
fi
rustup component add clippy rustfmt >/dev/null 2>&1 || true
