#!/usr/bin/env bash
# Installs guidellm, the peer load generator e2e/test_load_generator.py drives our endpoints
# with, into a virtualenv of its own in the cache, keyed by version (it brings its own torch and
# transformers, which must not move the project's pins). A warm run only checks the stamp.
#
#   e2e/tools/install-guidellm.sh            install if missing, print the guidellm binary
#   e2e/tools/install-guidellm.sh --print    print the binary without installing
set -euo pipefail

GUIDELLM_VERSION=0.8.1

CACHE_ROOT=${PHASEFLEET_CACHE:-$HOME/.cache/phasefleet}
DIR="$CACHE_ROOT/guidellm-$GUIDELLM_VERSION"
BIN="$DIR/bin/guidellm"

if [[ "${1:-}" == "--print" || -f "$DIR/.installed" ]]; then
  echo "$BIN"
  exit 0
fi
echo "[install] guidellm $GUIDELLM_VERSION into $DIR" >&2
rm -rf "$DIR"
"${PYTHON:-python3.11}" -m venv "$DIR"
"$DIR/bin/python" -m pip install -q --upgrade pip
"$DIR/bin/python" -m pip install -q "guidellm==$GUIDELLM_VERSION"
"$BIN" --version >/dev/null
touch "$DIR/.installed"
echo "$BIN"
