#!/usr/bin/env bash
# Install apps into a SuperNode's trusted app store, the only apps deploy/supernode.sh runs.
#
#   deploy/trust-app.sh -s STORE APP...
#
#   -s STORE  the store folder (created if missing; give it to supernode.sh -a STORE)
#   APP       a FAB file (`flwr build`), or an app folder to build one from (e.g. this checkout)
#
# A run's app is identified by the SHA-256 of its FAB, which `flwr run` builds from the operator's
# folder; Flower's build is deterministic, so the same files give the same FAB. Distribute one FAB
# (or one commit) to the operators and the nodes. The store is left read-only: run this as the
# store's owner (e.g. root) and the node as another, unprivileged user.
set -euo pipefail
STORE=""
while getopts "s:h" opt; do
  case $opt in s) STORE=$OPTARG ;; *) sed -n '2,12p' "$0"; exit 2 ;; esac
done
shift $((OPTIND - 1))
[ -n "$STORE" ] && [ $# -ge 1 ] || { sed -n '2,12p' "$0"; exit 2; }
. "$(dirname "$0")/_common.sh"
find_flower flwr
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$STORE/apps"
chmod -R u+w "$STORE"
for app in "$@"; do
  if [ -d "$app" ]; then
    dir=$(cd "$app" && pwd)
    (cd "$TMP" && rm -f ./*.fab && FLWR_HOME="$TMP/home" "$BIN" build --app "$dir" >/dev/null)
    fab=$(echo "$TMP"/*.fab)
  else
    fab=$app
  fi
  [ -f "$fab" ] || { echo "trust-app.sh: $app is neither a FAB file nor an app folder" >&2; exit 1; }
  sha=$(sha256sum "$fab" | cut -d' ' -f1)
  compgen -G "$STORE/apps/*.${sha:0:8}" >/dev/null || FLWR_HOME=$STORE "$BIN" install "$fab" >/dev/null
  echo "trust-app.sh: trusted $(basename "$fab") sha256 $sha"
done
chmod -R a-w "$STORE"
