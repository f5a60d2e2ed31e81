#!/bin/sh
# Issue 19 item 5: how long a small push waits before its first data byte, through
# wanxfer-emu. Runs N pushes of one 20 kB file from the left host to a server on the
# right one at RTT, and prints each run's wall clock (whole command), its counted round
# trips to the first data byte and to the session, and the seconds to the first byte
# (from `--json`; runs of older builds print only the wall clock and their fixed count).
#
#   bench/first_byte.sh [WANXFER] [EMU] [RTT] [N]
#   bench/first_byte.sh target/debug/wanxfer target/debug/wanxfer-emu 200ms 5
set -eu
wanxfer=$(realpath "${1:-target/debug/wanxfer}")
emu=$(realpath "${2:-target/debug/wanxfer-emu}")
rtt=${3:-100ms}
runs=${4:-5}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/root" "$dir/state" "$dir/server-state"
head -c 20000 /dev/urandom >"$dir/small.bin"
"$wanxfer" serve --help >/dev/null
cat >"$dir/left.sh" <<SCRIPT
export WANXFER_STATE_DIR=$dir/state
for i in \$(seq $runs); do
  start=\$(date +%s.%N)
  "$wanxfer" cp --secret-file "$dir/secret" --json "$dir/small.bin" wanxfer://10.77.0.2:7800/small\$i.bin >"$dir/out"
  end=\$(date +%s.%N)
  python3 -c "import json,sys; j=json.load(open('$dir/out')); print('wall %.3f s  setup_round_trips %s  session_round_trips %s  setup_seconds %s' % (\$end-\$start, j.get('setup_round_trips'), j.get('session_round_trips', '-'), j.get('setup_seconds', '-')))" >>"$dir/results"
done
SCRIPT
"$emu" --rtt "$rtt" --rate 100mbit --buffer 2MB \
  --right "WANXFER_STATE_DIR=$dir/server-state $wanxfer serve --root $dir/root --listen 10.77.0.2:7800 --secret-file $dir/secret" \
  --settle 1.5 \
  --left "sh $dir/left.sh" >/dev/null 2>"$dir/emu.log"
cat "$dir/results"
