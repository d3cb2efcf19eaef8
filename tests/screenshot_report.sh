#!/usr/bin/env bash
# Render a report page to PNG with headless Chromium (Debian package: chromium), to look at it as a reader would.
#   bash tests/screenshot_report.sh report/<name> [out.png] [width] [height]
set -euo pipefail
dir=$(cd "$1" && pwd)
out=${2:-$dir/screenshot.png}
width=${3:-1400}
height=${4:-4200}
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$profile" --hide-scrollbars \
    --window-size="$width,$height" --screenshot="$out" "file://$dir/index.html" 2>/dev/null
echo "wrote $out"
