#!/usr/bin/env bash
# Make the base image of docker/Dockerfile from Debian's packages alone, for a machine that cannot
# reach a container registry: Debian 12 (bookworm) with its Python 3.11, venv, CA certificates,
# nginx (the gateway) and tini. Needs root, debootstrap and a Docker engine.
#
#   docker/make-base-image.sh [-t TAG] [-m MIRROR]
#
#   -t TAG     the image to create (default fedskew-base:bookworm)
#   -m MIRROR  the Debian mirror (default http://deb.debian.org/debian)
#
# Then: docker build --build-arg BASE_IMAGE=fedskew-base:bookworm -f docker/Dockerfile .
# (docker/demo.sh does both). With registry access the default BASE_IMAGE python:3.11-slim-bookworm
# works as well.
set -euo pipefail
TAG=fedskew-base:bookworm MIRROR=http://deb.debian.org/debian
while getopts "t:m:h" opt; do
  case $opt in t) TAG=$OPTARG ;; m) MIRROR=$OPTARG ;; *) sed -n '2,13p' "$0"; exit 2 ;; esac
done
[ "$(id -u)" = 0 ] || { echo "make-base-image.sh: debootstrap needs root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "make-base-image.sh: apt-get install debootstrap" >&2; exit 1; }
command -v docker >/dev/null || { echo "make-base-image.sh: the docker CLI is required" >&2; exit 1; }
ROOTFS=$(mktemp -d "${TMPDIR:-/var/tmp}/fedskew-rootfs.XXXXXX")
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,nginx-light,tini \
  bookworm "$ROOTFS" "$MIRROR"
# no package caches, no service left enabled, a clean machine identity
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/*.log
: >"$ROOTFS/etc/machine-id"
tar -C "$ROOTFS" --numeric-owner -c . |
  docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' - "$TAG" >/dev/null
echo "make-base-image.sh: $TAG ($(docker image inspect -f '{{.Size}}' "$TAG" | numfmt --to=iec))"
