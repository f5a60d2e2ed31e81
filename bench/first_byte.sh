#!/bin/sh
# Issue 19 item 5: how long a small transfer waits before its first data byte, through
# wanxfer-emu. Runs N pushes (or pulls) of one 20 kB file between the left host and a
# server on the right one at RTT, and prints each run's wall clock (whole command), its
# counted round trips to the first data byte and to the session, and the seconds to the
# first block (from `--json`; runs of older builds print only the wall clock and their
# fixed count). A pull goes each time into a destination that does not exist yet;
# `pull-into` into an existing empty directory, `pull-over` into one holding an older
# file of the name. `fabric-push` pushes over the fabric transport (tcp provider,
# unencrypted, as fabric sessions are).
#
#   bench/first_byte.sh [WANXFER] [EMU] [RTT] [N] [push|pull|pull-into|pull-over|fabric-push]
#   bench/first_byte.sh target/debug/wanxfer target/debug/wanxfer-emu 200ms 5 pull
set -eu
wanxfer=$(realpath "${1:-target/debug/wanxfer}")
emu=$(realpath "${2:-target/debug/wanxfer-emu}")
rtt=${3:-100ms}
runs=${4:-5}
mode=${5:-push}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/root" "$dir/state" "$dir/server-state"
head -c 20000 /dev/urandom >"$dir/small.bin"
cp "$dir/small.bin" "$dir/root/small.bin"
# What each run copies ($i is the run's number, expanded in left.sh).
# What each run prepares first.
prepare=true
# Flags of the client and the server beyond the defaults.
client_flags=
server_flags=
case $mode in
push) copy="$dir/small.bin wanxfer://10.77.0.2:7800/small\$i.bin" ;;
fabric-push)
  copy="$dir/small.bin wanxfer://10.77.0.2:7800/small\$i.bin"
  client_flags="--transport fabric --provider tcp --no-encryption"
  server_flags="--transport fabric --provider tcp --allow-unencrypted"
  ;;
pull) copy="wanxfer://10.77.0.2:7800/small.bin $dir/pulled\$i.bin" ;;
pull-into)
  copy="wanxfer://10.77.0.2:7800/small.bin $dir/into\$i"
  prepare="mkdir $dir/into\$i"
  ;;
pull-over)
  copy="wanxfer://10.77.0.2:7800/small.bin $dir/into\$i"
  prepare="mkdir $dir/into\$i && head -c 20000 /dev/urandom >$dir/into\$i/small.bin"
  ;;
*) echo "mode is push, pull, pull-into, pull-over or fabric-push, not $mode" >&2; exit 2 ;;
esac
"$wanxfer" serve --help >/dev/null
cat >"$dir/left.sh" <<SCRIPT
export WANXFER_STATE_DIR=$dir/state
for i in \$(seq $runs); do
  $prepare
  start=\$(date +%s.%N)
  "$wanxfer" cp --secret-file "$dir/secret" --json $client_flags $copy >"$dir/out"
  end=\$(date +%s.%N)
  python3 -c "import json,sys; j=json.load(open('$dir/out')); print('wall %.3f s  setup_round_trips %s  session_round_trips %s  setup_seconds %s' % (\$end-\$start, j.get('setup_round_trips'), j.get('session_round_trips', '-'), j.get('setup_seconds', '-')))" >>"$dir/results"
done
SCRIPT
"$emu" --rtt "$rtt" --rate 100mbit --buffer 2MB \
  --right "WANXFER_STATE_DIR=$dir/server-state $wanxfer serve --root $dir/root --listen 10.77.0.2:7800 --secret-file $dir/secret $server_flags" \
  --settle 1.5 \
  --left "sh $dir/left.sh" >/dev/null 2>"$dir/emu.log"
cat "$dir/results"
