#!/usr/bin/env bash
# Installs the peer tools that bench/peers.py and bench/secure.py compare
# wanxfer with (Debian 12 names).
# Bench only: CI and the test suite do not need these (see scripts/install-deps.sh).
# Idempotent: packages already present are skipped.
set -euo pipefail

PACKAGES=(
  globus-gridftp-server-progs     # globus-gridftp-server
  globus-gass-copy-progs          # globus-url-copy
  globus-proxy-utils              # grid-proxy-init (secure.py: GridFTP with -dcpriv)
  openssh-server openssh-client   # secure.py: a throwaway sshd for rsync, scp, sftp
  xrootd-server xrootd-client     # xrootd, xrdcp
  rsync                           # rsync --daemon
  socat                           # tar | socat
  iperf3                          # the memory-to-memory ceiling
  python3
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
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
