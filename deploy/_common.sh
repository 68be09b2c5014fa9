# Sourced by superlink.sh / supernode.sh: Flower's offline settings and where its binaries are.
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1

# find_flower NAME: the NAME executable on PATH, else in this checkout's .venv; puts its folder first
# on PATH so that flower-superexec / flwr-serverapp / flwr-clientapp next to it are found too.
find_flower() {
  BIN=$(command -v "$1" || true)
  [ -n "$BIN" ] || BIN="$(dirname "$0")/../.venv/bin/$1"
  export PATH="$(dirname "$BIN"):$PATH"
}
