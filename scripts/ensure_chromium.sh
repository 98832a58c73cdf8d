#!/usr/bin/env bash
# Make Debian's headless-capable Chromium available for the map's browser test. Idempotent: does nothing when
# /usr/bin/chromium exists. Needs root (the test set-up runs it as root); the package cache makes reruns cheap.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "ensure_chromium: /usr/bin/chromium is missing and installing it needs root" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium >/dev/null
test -x /usr/bin/chromium
