#!/usr/bin/env bash
# Builds the Debian package: the wanxfer binary, its man pages and bash/zsh/fish
# completions (generated from its flags), the sandboxed systemd service with its system
# user, and /etc/wanxfer/wanxfer.toml. The .deb's path is the last line printed.
#
#   scripts/build-deb.sh                    # release build, as shipped
#   scripts/build-deb.sh --profile dev      # reuse a debug build (what the package test does)
#   scripts/build-deb.sh --output DIR       # any other flag goes to cargo deb
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

profile=release
pass=()
while (($#)); do
  case "$1" in
    --profile) profile="$2"; shift 2 ;;
    --profile=*) profile="${1#--profile=}"; shift ;;
    *) pass+=("$1"); shift ;;
  esac
done

# Pinned: the package test packages the debug build CI has already made, which this
# version accepts (with a warning) and a later one may refuse.
CARGO_DEB_VERSION=3.8.0
if [ "$(cargo deb --version 2>/dev/null)" != "cargo-deb $CARGO_DEB_VERSION" ]; then
  echo "installing cargo-deb $CARGO_DEB_VERSION" >&2
  cargo install cargo-deb --locked --quiet --version "$CARGO_DEB_VERSION"
fi

cargo build --quiet --profile "$profile" -p wanxfer
target_dir=$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
profile_dir="$profile"
[ "$profile" = dev ] && profile_dir=debug
# cargo deb reads the `target/release/assets/...` entries of [package.metadata.deb]
# from this profile's directory.
assets="$target_dir/$profile_dir/assets"
rm -rf "$assets"
"$target_dir/$profile_dir/wanxfer" generate-assets --out "$assets" >/dev/null
gzip -9n "$assets"/man/*.1 # Debian installs man pages compressed
cargo deb --package wanxfer --no-build --profile "$profile" ${pass[@]+"${pass[@]}"}
