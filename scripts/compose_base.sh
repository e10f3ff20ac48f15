#!/usr/bin/env bash
# A Debian bookworm base image for the Dockerfile's BASE_IMAGE, made without any image registry:
# debootstrap (minbase) from Debian's packages, then `docker import`. It stands in for python:3.11-slim
# where no registry can be reached: bookworm's python3 is 3.11 too, and the Dockerfile installs into a venv.
#   bash scripts/compose_base.sh [TAG]      (default pagedserve-base:bookworm; kept if it exists already)
# Needs root, debootstrap and a running docker daemon; reaches only the Debian mirror ($DEBIAN_MIRROR).
set -euo pipefail

tag=${1:-pagedserve-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

log() { echo "compose_base: $*" >&2; }

if docker image inspect "$tag" >/dev/null 2>&1; then
    log "$tag exists, kept (docker rmi $tag to make it again)"
    exit 0
fi
command -v debootstrap >/dev/null || { log "debootstrap is missing (apt-get install debootstrap)"; exit 1; }

root=$(mktemp -d /var/tmp/pagedserve-base.XXXXXX)
trap 'rm -rf "$root"' EXIT

log "debootstrap bookworm into $root from $mirror"
# python3-venv brings ensurepip's wheels, so `python3 -m venv` gives the venv a pip.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" \
    >"$root.log" 2>&1 || { tail -n 30 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# The .debs and package lists are only needed to install, and weigh more than Python itself.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/* "$root"/var/log/*
log "importing as $tag"
tar -C "$root" --numeric-owner -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
    -m "debootstrap --variant=minbase bookworm" - "$tag" >/dev/null
docker image ls "$tag" >&2
