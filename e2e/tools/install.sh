#!/usr/bin/env bash
# Builds the real Kubernetes control plane and its tools from published Go modules into a
# cache outside the repository, keyed by version. A warm run only checks the stamp files.
#
#   e2e/tools/install.sh            build everything missing, print the bin dir
#   e2e/tools/install.sh --print    print the bin dir without building
set -euo pipefail

K8S_VERSION=v1.33.13        # kube-apiserver, controller-manager, scheduler, kubectl
STAGING_VERSION=v0.33.13    # the matching k8s.io/* staging modules
KWOK_VERSION=v0.7.0         # its go.mod targets Kubernetes 1.33
ETCD_VERSION=v3.5.21        # the etcd that Kubernetes 1.33 is tested with
HELM_VERSION=v3.18.6        # built against client-go 0.33

CACHE_ROOT=${PHASEFLEET_CACHE:-$HOME/.cache/phasefleet}
KEY="k8s-${K8S_VERSION}_kwok-${KWOK_VERSION}_etcd-${ETCD_VERSION}_helm-${HELM_VERSION}"
TOOLS_DIR="$CACHE_ROOT/tools/$KEY"
BIN="$TOOLS_DIR/bin"

if [[ "${1:-}" == "--print" ]]; then
  echo "$BIN"
  exit 0
fi

mkdir -p "$BIN" "$TOOLS_DIR/src"
export GOFLAGS="-mod=mod -buildvcs=false -trimpath"
export GOCACHE="$CACHE_ROOT/go-build"
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
log() { echo "[install] $*" >&2; }

# Scratch module helper: writes go.mod for a throwaway main module that depends on $2@$3.
# `go mod tidy -e` fills go.sum for the whole graph; it may complain about test-only
# dependencies of the upstream modules, so its status is ignored: the `go build` after it is
# the real check.
scratch_module() {
  local dir=$1 module=$2 version=$3
  rm -rf "$dir"
  mkdir -p "$dir"
  (cd "$dir" && go mod init "phasefleet.local/build/$(basename "$dir")" >/dev/null 2>&1 \
     && go mod edit -require="$module@$version")
}

build_kubernetes() {
  local stamp="$BIN/.kubernetes.done"
  [[ -f "$stamp" ]] && return 0
  log "building Kubernetes $K8S_VERSION (cold: about 7 minutes on 2 cores)"
  local dir="$TOOLS_DIR/src/kubernetes"
  scratch_module "$dir" k8s.io/kubernetes "$K8S_VERSION"
  # k8s.io/kubernetes points every staging module at ./staging in its own go.mod; a consumer
  # must replace each one with the published v0.Y.Z of the same release.
  local gomod
  gomod=$(cd "$dir" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
            | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  local staging
  staging=$(grep -oE '^\s*k8s\.io/[a-z0-9-]+ => \./staging' "$gomod" | awk '{print $1}')
  local replaces=()
  for m in $staging; do replaces+=("-replace=$m=$m@$STAGING_VERSION"); done
  log "replacing ${#replaces[@]} staging modules with $STAGING_VERSION"
  (cd "$dir" && go mod edit "${replaces[@]}")
  cat > "$dir/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
  (cd "$dir" && go mod tidy -e >/dev/null 2>&1 || true)
  local minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  local vpkg=k8s.io/component-base/version
  local ldflags="-s -w -X $vpkg.gitVersion=$K8S_VERSION -X $vpkg.gitMajor=1 -X $vpkg.gitMinor=$minor"
  ldflags+=" -X $vpkg.gitTreeState=clean -X $vpkg.buildDate=1970-01-01T00:00:00Z"
  ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
  ldflags+=" -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$minor"
  (cd "$dir" && go build -tags tools -ldflags "$ldflags" -o "$BIN/" \
      k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl)
  touch "$stamp"
}

build_simple() {  # name module version package [ldflags]
  local name=$1 module=$2 version=$3 pkg=$4 ldflags=${5:-"-s -w"}
  local stamp="$BIN/.$name.done"
  [[ -f "$stamp" ]] && return 0
  log "building $name $version"
  local dir="$TOOLS_DIR/src/$name"
  scratch_module "$dir" "$module" "$version"
  printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$pkg" > "$dir/tools.go"
  (cd "$dir" && go mod tidy -e >/dev/null 2>&1 || true)
  (cd "$dir" && go build -tags tools -ldflags "$ldflags" -o "$BIN/$name" "$pkg")
  touch "$stamp"
}

build_kubernetes
build_simple kwok sigs.k8s.io/kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok \
  "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
build_simple etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION" go.etcd.io/etcd/server/v3
build_simple helm helm.sh/helm/v3 "$HELM_VERSION" helm.sh/helm/v3/cmd/helm \
  "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
echo "$BIN"
