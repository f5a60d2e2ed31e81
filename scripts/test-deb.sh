#!/usr/bin/env bash
# The Debian package, end to end: builds it (from the debug build the test suite made),
# installs it with dpkg into a scratch root, maintainer scripts included, then uses what
# was installed: the system user its postinst made, its configuration, man pages and
# completions, its binary serving a directory on 127.0.0.1 with a file copied through
# it, its systemd unit through `systemd-analyze verify`, and a purge. Needs root;
# removes everything it made, and never touches the host's users, units or /srv.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

if [ "$(id -u)" -ne 0 ]; then
  echo "test-deb: skipped: installing into a scratch root with dpkg needs root"
  exit 0
fi

scratch=$(mktemp -d /tmp/wanxfer-deb.XXXXXX)
server_pid=
cleanup() {
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$scratch"
}
trap cleanup EXIT

passes=0
failures=0
check() { # check DESCRIPTION COMMAND...
  local what="$1"; shift
  if "$@"; then
    echo "ok: $what"; passes=$((passes + 1))
  else
    echo "FAILED: $what"; failures=$((failures + 1))
  fi
}

echo "== building the package"
deb=$(scripts/build-deb.sh --profile dev --output "$scratch/out" | tail -n 1)
[ -f "$deb" ] || { echo "FAILED: build-deb.sh made no package ($deb)"; exit 1; }
dpkg-deb --info "$deb" | sed -n 's/^ \(Package\|Version\|Depends\):/  \1:/p'

echo "== installing into $scratch/root"
root="$scratch/root"
admin="$root/var/lib/dpkg"
mkdir -p "$admin/info" "$admin/updates" "$root/usr/sbin" "$root/etc"
touch "$admin/status" "$admin/available"
# What image builders do so that no service starts; deb-systemd-invoke reads it from
# $DPKG_ROOT.
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"
host_had_user=no
getent passwd wanxfer >/dev/null && host_had_user=yes
# dpkg runs the maintainer scripts outside the root with DPKG_ROOT set
# (--force-script-chrootless), as they are written to allow. In a private mount
# namespace with /run/systemd hidden, their systemd steps (daemon-reload, tmpfiles)
# see no running systemd and leave the host alone.
dpkg_in_root() {
  unshare --mount --propagation private sh -c '
    if [ -d /run/systemd ]; then mount -t tmpfs tmpfs /run/systemd; fi
    exec "$@"' sh \
    dpkg --root="$root" --log="$scratch/dpkg.log" --force-script-chrootless --force-depends "$@"
}
dpkg_in_root --install "$deb" >"$scratch/dpkg.out" 2>&1 || { cat "$scratch/dpkg.out"; exit 1; }

installed() { [ "$(dpkg-query --admindir="$admin" -W -f='${Status}' wanxfer)" = "install ok installed" ]; }
check "dpkg records the package as installed" installed
check "the postinst created the system user in the root" grep -q '^wanxfer:x:[0-9]*:[0-9]*:.*:/var/lib/wanxfer:' "$root/etc/passwd"
check "  and its group" grep -q '^wanxfer:' "$root/etc/group"
if [ "$host_had_user" = no ]; then
  check "  but not on the host" sh -c '! getent passwd wanxfer >/dev/null'
fi
conffile() { dpkg-query --admindir="$admin" -W -f='${Conffiles}' wanxfer | grep -q '^ /etc/wanxfer/wanxfer.toml '; }
check "/etc/wanxfer/wanxfer.toml is a conffile" conffile
for page in wanxfer wanxfer-serve wanxfer-cp wanxfer-bench; do
  check "man page $page(1)" sh -c "zcat '$root/usr/share/man/man1/$page.1.gz' | grep -q '^\.TH'"
done
check "the serve page names --max-session-memory" sh -c "zcat '$root/usr/share/man/man1/wanxfer-serve.1.gz' | grep -q 'max\\\\-session\\\\-memory'"
check "bash completion registers" bash -c "source '$root/usr/share/bash-completion/completions/wanxfer' && complete -p wanxfer >/dev/null"
check "zsh completion" grep -q '^#compdef wanxfer' "$root/usr/share/zsh/vendor-completions/_wanxfer"
check "fish completion" grep -q '^complete -c wanxfer' "$root/usr/share/fish/vendor_completions.d/wanxfer.fish"
served_dir_owned() {
  systemd-tmpfiles --root="$root" --create wanxfer.conf || return 1
  local ids
  ids=$(awk -F: '$1 == "wanxfer" { print $3 ":" $4 }' "$root/etc/passwd")
  [ "$(stat -c %u:%g:%a "$root/srv/wanxfer")" = "$ids:750" ]
}
check "systemd-tmpfiles makes the served directory, the user's, mode 750" served_dir_owned

echo "== the installed binary"
bin="$root/usr/bin/wanxfer"
check "the packaged configuration is valid" "$bin" serve --check-config "$root/etc/wanxfer/wanxfer.toml"
mkdir "$scratch/served"
# The packaged configuration, with the paths that belong to a real installation
# (/srv/wanxfer, /var/lib/wanxfer, /var/log/wanxfer) and the address overridden on the
# command line.
"$bin" serve --config "$root/etc/wanxfer/wanxfer.toml" --root "$scratch/served" \
  --listen 127.0.0.1:0 --secret-file "$scratch/secret" --transfer-log "$scratch/transfers.log" \
  >"$scratch/serve.out" 2>"$scratch/serve.log" &
server_pid=$!
addr=
for _ in $(seq 200); do
  addr=$(sed -n 's/^wanxfer serving .* on //p' "$scratch/serve.out")
  [ -n "$addr" ] && break
  kill -0 "$server_pid" 2>/dev/null || break
  sleep 0.05
done
if [ -z "$addr" ]; then
  echo "FAILED: the installed server did not start:"; cat "$scratch/serve.log"; exit 1
fi
head -c 3000000 /dev/urandom >"$scratch/payload"
check "cp through the installed server" "$bin" cp -q --secret-file "$scratch/secret" "$scratch/payload" "wanxfer://$addr/copied"
check "  and the copy is identical" cmp -s "$scratch/payload" "$scratch/served/copied"
# The server writes a session's record as the session ends on its side, which may be just
# after the client, told the transfer is done, has exited: wait for it, boundedly.
logged() {
  for _ in $(seq 100); do
    grep -q '"direction":"push"' "$scratch/transfers.log" 2>/dev/null && return 0
    sleep 0.05
  done
  return 1
}
check "  and the transfer log has its record" logged
kill "$server_pid"; wait "$server_pid" 2>/dev/null || true; server_pid=

echo "== the installed unit"
# systemd-analyze resolves the unit's dependencies (sysinit.target, ...) in the root too.
mkdir -p "$root/etc/systemd/system"
cp -a /usr/lib/systemd/system/. "$root/etc/systemd/system/"
verify() {
  local out
  out=$(systemd-analyze --man=no --root="$root" verify "$root/usr/lib/systemd/system/wanxfer.service" 2>&1) || { echo "$out"; return 1; }
  # It exits 0 on settings it ignores; any word from it is a problem.
  [ -z "$out" ] || { echo "$out"; return 1; }
}
check "systemd-analyze verify wanxfer.service" verify
for setting in 'ProtectSystem=strict' 'ReadWritePaths=/srv/wanxfer' 'ProtectHome=yes' 'PrivateTmp=yes' \
  'NoNewPrivileges=yes' 'LimitMEMLOCK=infinity' 'User=wanxfer' 'Restart=on-failure' 'KillSignal=SIGTERM'; do
  check "  $setting" grep -qx "$setting" "$root/usr/lib/systemd/system/wanxfer.service"
done

echo "== purging"
mkdir -p "$root/var/lib/wanxfer" && echo secret >"$root/var/lib/wanxfer/secret"
dpkg_in_root --purge wanxfer >"$scratch/dpkg.out" 2>&1 || { cat "$scratch/dpkg.out"; exit 1; }
check "purge removes the binary, the configuration and the state" sh -c "
  [ ! -e '$bin' ] && [ ! -e '$root/etc/wanxfer/wanxfer.toml' ] && [ ! -e '$root/var/lib/wanxfer' ]"

echo "test-deb: $passes passed, $failures failed"
[ "$failures" -eq 0 ]
