#!/usr/bin/env bash
# Vendor Chart.js for the dashboard from the npm registry (proxy/admin/static/VENDOR.md).
#   scripts/update_chartjs.sh           the version pinned below
#   scripts/update_chartjs.sh 4.7.0     another version (then update PINNED and the note)
#   scripts/update_chartjs.sh --check   the vendored file is the pinned release's, byte for byte
set -euo pipefail
PINNED=4.6.1
cd "$(dirname "$0")/.."
DEST=proxy/admin/static/chart.umd.min.js
VERSION=${1:-$PINNED}
[ "$VERSION" = "--check" ] && VERSION=$PINNED
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
(cd "$WORK" && npm pack --silent "chart.js@$VERSION" >/dev/null && tar xzf chart.js-*.tgz)
if [ "${1:-}" = "--check" ]; then
  cmp "$WORK/package/dist/chart.umd.min.js" "$DEST" && echo "ok: $DEST is chart.js@$PINNED"
  exit
fi
cp "$WORK/package/dist/chart.umd.min.js" "$DEST"
sed -i "s/Chart.js \*\*[0-9.]*\*\*/Chart.js **$VERSION**/; s/chart.js@[0-9.]*/chart.js@$VERSION/g" \
  proxy/admin/static/VENDOR.md
echo "vendored chart.js@$VERSION into $DEST ($(sha256sum "$DEST" | cut -c1-16)...)"
