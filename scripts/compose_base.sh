#!/usr/bin/env bash
# Debian bookworm base images for the Dockerfile, made without any image registry: debootstrap (minbase)
# from Debian's packages, then `docker import`. TAG, for BASE_IMAGE, stands in for python:3.11-slim where no
# registry can be reached: bookworm's python3 is 3.11 too, and the Dockerfile installs into a venv. TAG-build,
# for BUILD_IMAGE, is the same with g++ and Python's headers added, which the build stage compiles the C++
# CPU kernels with; the image the stack runs has no compiler.
#   bash scripts/compose_base.sh [TAG]      (default pagedserve-base:bookworm; both kept if they exist already)
# Needs root, debootstrap and a running docker daemon; reaches only the Debian mirror ($DEBIAN_MIRROR).
set -euo pipefail

tag=${1:-pagedserve-base:bookworm}
build_tag=$tag-build
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

log() { echo "compose_base: $*" >&2; }

if docker image inspect "$tag" >/dev/null 2>&1 && docker image inspect "$build_tag" >/dev/null 2>&1; then
    log "$tag and $build_tag exist, kept (docker rmi $tag $build_tag to make them again)"
    exit 0
fi
command -v debootstrap >/dev/null || { log "debootstrap is missing (apt-get install debootstrap)"; exit 1; }

root=$(mktemp -d /var/tmp/pagedserve-base.XXXXXX)
trap 'rm -rf "$root" "$root.log"' EXIT

# Logs to $root.log, shown when the step fails.
quiet() { "$@" >"$root.log" 2>&1 || { tail -n 30 "$root.log" >&2; exit 1; }; }

# The .debs and package lists are only needed to install, and weigh more than Python itself.
import_as() {
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/* "$root"/var/log/*
    log "importing as $1"
    tar -C "$root" --numeric-owner -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
        -m "$2" - "$1" >/dev/null
}

log "debootstrap bookworm into $root from $mirror"
# python3-venv brings ensurepip's wheels, so `python3 -m venv` gives the venv a pip.
quiet debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror"
import_as "$tag" "debootstrap --variant=minbase bookworm"

log "adding g++ and python3-dev, for $build_tag"
cp /etc/resolv.conf "$root/etc/resolv.conf"  # apt in the chroot resolves the mirror as the host does
export DEBIAN_FRONTEND=noninteractive
quiet chroot "$root" apt-get update -q
quiet chroot "$root" apt-get install -y -q --no-install-recommends g++ python3-dev
: >"$root/etc/resolv.conf"  # docker mounts its own over it
import_as "$build_tag" "debootstrap --variant=minbase bookworm, with g++ and python3-dev"
docker image ls "${tag%%:*}" >&2
