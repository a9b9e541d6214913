#!/usr/bin/env bash
# Build the project's Dockerfile here, with podman, on a Python base made from Debian's
# packages: this machine reaches no image registry (only Debian's mirror and PyPI).
#
# Usage: e2e/image.sh [packages|base|cpu|cuda ...]   (default: all four, in that order)
#        e2e/image.sh ref base|cpu|cuda              (the reference the current inputs give)
#        e2e/image.sh env                            (CONTAINERS_CONF=..., for podman by hand)
#        e2e/image.sh podman ARGS...                 (podman with this script's settings)
#        e2e/image.sh clean-images                   (remove every image and container here)
#
# As root (rootful podman); apt-get installs what is missing.
# - packages: podman, runc, mmdebstrap and the CNI plugins from apt, if missing.
# - base: `mmdebstrap` of Debian $IMAGE_BASE_SUITE with python3, python3-venv, passwd,
#   ca-certificates and libstdc++6 (wheels such as NumPy's need it, as manylinux assumes),
#   imported as localhost/flowmill-base:<suite>-<key>; the key hashes the suite, mirrors,
#   package list and dpkg options.
# - cpu, cuda: `podman build` of the Dockerfile's two targets on that base, tagged
#   localhost/flowmill:<key> and localhost/flowmill:<key>-cuda (and :<version>,
#   :<version>-cuda); the key hashes the base's and every file in the build context (the
#   `!` entries of .dockerignore) with the Dockerfile. An image that exists is not
#   rebuilt; a new one replaces the older images of its target.
#
# podman runs with a configuration of its own (no file in /etc is changed):
# $FLOWMILL_CACHE/containers/{containers,storage}.conf, named by CONTAINERS_CONF and
# CONTAINERS_STORAGE_CONF: images under $FLOWMILL_CACHE/containers/storage; the `runc`
# runtime (crun refuses the hybrid cgroup v1 layout here) with the cgroupfs manager (PID 1
# is no systemd); no default ulimits (podman's defaults raise RLIMIT_NOFILE/NPROC, which
# this machine does not permit); the CNI bridge's config kept beside the storage.
#
# Environment: FLOWMILL_CACHE (default ~/.cache/flowmill), FLOWMILL_NICE (default 19),
# FLOWMILL_IMAGE_CA (the CA bundle pip trusts in the build; default $PIP_CERT, else
# /etc/ssl/certs/ca-certificates.crt), PIP_INDEX_URL and PIP_DEFAULT_TIMEOUT (passed on).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"

CACHE="${FLOWMILL_CACHE:-$HOME/.cache/flowmill}"
LOGS="$CACHE/build-logs"
IMAGES="$CACHE/images"          # base rootfs tarballs, build times
PODDIR="$CACHE/containers"      # podman's configuration, storage and network config
NICE=(nice -n "${FLOWMILL_NICE:-19}")

trap 'echo "[image] failed at line $LINENO: $BASH_COMMAND" >&2' ERR

log() { printf '[image %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

hash12() { sha256sum | cut -c1-12; }

# ---- podman's settings ------------------------------------------------------------------

export CONTAINERS_CONF="$PODDIR/containers.conf"
export CONTAINERS_STORAGE_CONF="$PODDIR/storage.conf"

write_podman_conf() {
  mkdir -p "$PODDIR/storage" "$PODDIR/cni" "$IMAGES" "$LOGS"
  cat > "$CONTAINERS_CONF.tmp" <<CONF
# Written by e2e/image.sh: podman's settings for the project's image builds and tests.
[containers]
# podman's defaults raise RLIMIT_NOFILE and RLIMIT_NPROC, which this machine refuses:
# containers inherit podman's limits instead.
default_ulimits = []

[engine]
# crun refuses the hybrid cgroup v1 layout; runc runs there. PID 1 is no systemd.
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "/run/flowmill-libpod"

[network]
# The default bridge (10.88.0.0/16) lives in memory; podman keeps its CNI state here.
network_config_dir = "$PODDIR/cni"
CONF
  cat > "$CONTAINERS_STORAGE_CONF.tmp" <<CONF
# Written by e2e/image.sh: the project's images, apart from any other podman storage.
[storage]
driver = "overlay"
graphroot = "$PODDIR/storage"
runroot = "/run/flowmill-containers"
CONF
  mv "$CONTAINERS_CONF.tmp" "$CONTAINERS_CONF"
  mv "$CONTAINERS_STORAGE_CONF.tmp" "$CONTAINERS_STORAGE_CONF"
}

# ---- keys and references ----------------------------------------------------------------

BASE_SUITE="$IMAGE_BASE_SUITE"
BASE_PACKAGES=(python3 python3-venv ca-certificates passwd libstdc++6)
BASE_MIRRORS=(
  "deb http://deb.debian.org/debian $BASE_SUITE main"
  "deb http://deb.debian.org/debian $BASE_SUITE-updates main"
  "deb http://deb.debian.org/debian-security $BASE_SUITE-security main"
)
# Documentation, manual pages and translations are left out of the base (not copyright).
BASE_DPKGOPTS=(
  'path-exclude=/usr/share/doc/*' 'path-include=/usr/share/doc/*/copyright'
  'path-exclude=/usr/share/man/*' 'path-exclude=/usr/share/info/*'
  'path-exclude=/usr/share/locale/*'
)

base_key() {
  printf '%s\n' "$BASE_SUITE" "${BASE_PACKAGES[@]}" "${BASE_MIRRORS[@]}" "${BASE_DPKGOPTS[@]}" \
    | hash12
}
base_ref() { echo "localhost/flowmill-base:$BASE_SUITE-$(base_key)"; }

# The build context is what .dockerignore lets through: its `!` entries (minus bytecode).
context_entries() { sed -n 's/^!\(.*\)$/\1/p' "$ROOT/.dockerignore"; }

image_key() {
  local entries
  mapfile -t entries < <(context_entries)
  {
    base_key
    (cd "$ROOT" && find Dockerfile .dockerignore "${entries[@]}" -type f \
        ! -path '*/__pycache__/*' ! -name '*.py[cod]' -print0 \
      | LC_ALL=C sort -z | xargs -0 sha256sum)
  } | hash12
}

project_version() { sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -n1; }

image_ref() {  # cpu|cuda
  case "$1" in
    cpu) echo "localhost/flowmill:$(image_key)" ;;
    cuda) echo "localhost/flowmill:$(image_key)-cuda" ;;
    base) base_ref ;;
    *) log "no such image: $1"; return 2 ;;
  esac
}

mb() { awk '{printf "%d", $1 / 1000000}'; }

image_mb() { podman image inspect --format '{{.Size}}' "$1" | mb; }

# One line per build in $LOGS/summary.tsv, beside the Go builds' lines.
record() {  # label key seconds what
  printf '%s\t%s\t%ss\t%s\n' "$1" "$2" "$3" "$4" | tee -a "$LOGS/summary.tsv" >&2
}

# ---- the steps --------------------------------------------------------------------------

build_packages() {
  local need=() t0
  command -v podman >/dev/null || need+=(podman)
  command -v runc >/dev/null || need+=(runc)
  command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
  [[ -x /usr/lib/cni/bridge ]] || need+=(containernetworking-plugins)
  if [[ ${#need[@]} -eq 0 ]]; then log "packages present"; return; fi
  command -v apt-get >/dev/null || { log "no apt-get to install ${need[*]}"; return 1; }
  log "installing ${need[*]} (apt-get)"
  t0=$SECONDS
  # Recommends would add buildah, slirp4netns, fuse-overlayfs: root needs none of them.
  local install=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q
                 --no-install-recommends podman runc mmdebstrap containernetworking-plugins)
  "${install[@]}" >&2 || { apt-get update -q >&2 && "${install[@]}" >&2; }
  record image-packages "$(podman --version | awk '{print $3}')" $((SECONDS - t0)) \
    "apt: ${need[*]}"
}

build_base() {
  local key ref tar t0
  key="$(base_key)"; ref="$(base_ref)"; tar="$IMAGES/base-$BASE_SUITE-$key.tar"
  if podman image exists "$ref"; then log "base $ref cached"; return; fi
  t0=$SECONDS
  if [[ ! -s "$tar" ]]; then
    log "base: mmdebstrap $BASE_SUITE with ${BASE_PACKAGES[*]}"
    local opts=() o
    for o in "${BASE_DPKGOPTS[@]}"; do opts+=("--dpkgopt=$o"); done
    # The essential variant plus the packages: no apt in the image.
    "${NICE[@]}" mmdebstrap --quiet --variant=essential --format=tar \
      --include="$(IFS=,; echo "${BASE_PACKAGES[*]}")" "${opts[@]}" \
      "$BASE_SUITE" "$tar.part" "${BASE_MIRRORS[@]}" </dev/null
    mv "$tar.part" "$tar"
  fi
  podman import --quiet \
    --message "Debian $BASE_SUITE: ${BASE_PACKAGES[*]} (e2e/image.sh)" "$tar" "$ref" >/dev/null
  record image-base "$BASE_SUITE-$key" $((SECONDS - t0)) \
    "rootfs $(du -m "$tar" | cut -f1)MB, image $(image_mb "$ref")MB"
  drop_older localhost/flowmill-base "$ref" "^$BASE_SUITE-[0-9a-f]{12}\$"
  find "$IMAGES" -maxdepth 1 -name "base-*.tar" ! -name "base-$BASE_SUITE-$key.tar" -delete
}

# Remove the images of one repository whose tags match a regular expression, but `keep`;
# then the layers no image uses. An image a container still uses stays.
drop_older() {  # repository keep tag-regex
  local repo="$1" keep="$2" regex="$3" tag
  while read -r tag; do
    if [[ "$repo:$tag" != "$keep" && $tag =~ $regex ]]; then
      podman rmi "$repo:$tag" >/dev/null 2>&1 || true
    fi
  done < <(podman images --format '{{.Tag}}' --filter "reference=$repo")
  podman image prune --force >/dev/null 2>&1 || true
}

build_image() {  # cpu|cuda
  local target="$1" ref key version tags t0 args=() ca
  ref="$(image_ref "$target")"; key="$(image_key)"; version="$(project_version)"
  if podman image exists "$ref"; then log "$target $ref cached"; return; fi
  podman image exists "$(base_ref)" || build_base
  log "$target: podman build --target $target (log: $LOGS/image-$target.log)"
  t0=$SECONDS
  tags=(--tag "$ref")
  if [[ $target == cpu ]]; then tags+=(--tag "localhost/flowmill:$version")
  else tags+=(--tag "localhost/flowmill:$version-cuda"); fi
  # pip in the build must trust this machine's CA bundle (PyPI is reached through a
  # TLS-intercepting proxy here): the bundle is mounted over the base's for the RUN steps
  # only (a build volume is never committed to a layer) and PIP_CERT names it, so nothing
  # of this machine's trust ends up in the images.
  ca="${FLOWMILL_IMAGE_CA:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}"
  if [[ -s "$ca" ]]; then
    args+=(--volume "$ca:/etc/ssl/certs/ca-certificates.crt:ro"
           --build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt)
  fi
  local v
  for v in PIP_INDEX_URL PIP_DEFAULT_TIMEOUT; do
    [[ -z "${!v:-}" ]] || args+=(--build-arg "$v=${!v}")
  done
  # No layer cache (--layers=false): the context is copied before pip runs, so a changed
  # source would miss it anyway, and the key above already skips an unchanged build.
  # --force-rm: no build container is left behind by a failed step either.
  "${NICE[@]}" podman build --layers=false --force-rm --target "$target" \
    --build-arg "PYTHON_IMAGE=$(base_ref)" "${args[@]}" "${tags[@]}" \
    --file "$ROOT/Dockerfile" "$ROOT" > "$LOGS/image-$target.log" 2>&1 \
    || { tail -n 40 "$LOGS/image-$target.log" >&2; return 1; }
  local secs=$((SECONDS - t0))
  echo "$secs" > "$IMAGES/$target-$key.seconds"
  record "image-$target" "$key" "$secs" "image $(image_mb "$ref")MB"
  if [[ $target == cpu ]]; then drop_older localhost/flowmill "$ref" '^[0-9a-f]{12}$'
  else drop_older localhost/flowmill "$ref" '^[0-9a-f]{12}-cuda$'; fi
  find "$IMAGES" -maxdepth 1 -name "$target-*.seconds" ! -name "$target-$key.seconds" -delete
}

clean_images() {
  log "removing every container and image in $PODDIR/storage"
  podman system reset --force
  rm -f "$IMAGES"/*.seconds
}

# ---- main -------------------------------------------------------------------------------

[[ "$(uname -s)" == Linux ]] || { log "podman images are built on Linux only"; exit 2; }
want=("$@")
[[ ${#want[@]} -gt 0 ]] || want=(packages base cpu cuda)
case "${want[0]}" in
  ref) [[ ${#want[@]} -eq 2 ]] || { log "usage: $0 ref base|cpu|cuda"; exit 2; }
       image_ref "${want[1]}"; exit ;;
  env) printf 'CONTAINERS_CONF=%s\nCONTAINERS_STORAGE_CONF=%s\n' \
         "$CONTAINERS_CONF" "$CONTAINERS_STORAGE_CONF"; exit ;;
esac
# Rootless podman would need subordinate ids, slirp4netns and a configuration of its own.
[[ $EUID -eq 0 ]] || { log "builds and runs images as root only (rootful podman)"; exit 1; }
write_podman_conf
case "${want[0]}" in
  podman) exec podman "${want[@]:1}" ;;
esac
# One build at a time: a second run waits, then finds the images built.
exec 9>"$IMAGES/.lock"
flock 9
for w in "${want[@]}"; do
  case "$w" in
    packages) build_packages ;;
    base) build_base ;;
    cpu|cuda) build_image "$w" ;;
    clean-images) clean_images ;;
    *) log "unknown step: $w"; exit 2 ;;
  esac
done
log "done: $(podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
  --filter reference=localhost/flowmill | tr '\n' ' ')"
