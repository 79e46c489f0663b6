#!/usr/bin/env bash
# Writes .dvc/plots_offline.html: DVC's plot page with vega, vega-lite and vega-embed inlined, so that `dvc plots
# show` / `dvc plots diff` render their interactive plots without a network (DVC's own page loads them from a CDN).
# The versions are the ones dvc_render's page names; .dvc/config points `plots.html_template` here. Rerun after a
# DVC upgrade that changes them (needs npm and the npm registry).
set -euo pipefail
cd "$(dirname "$0")/.."
versions=(vega@5.20.2 vega-lite@5.2.0 vega-embed@6.18.2)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "${versions[@]}" >/dev/null &&
  for f in *.tgz; do mkdir "${f%.tgz}"; tar -xzf "$f" -C "${f%.tgz}"; done)
out=.dvc/plots_offline.html
{
  echo '<!DOCTYPE html>'
  echo '<html>'
  echo '<head>'
  echo '    {refresh_tag}'
  echo '    <title>DVC Plot</title>'
  echo "    <!-- ${versions[*]} (BSD-3-Clause, from the npm registry), written by scripts/vendor_vega.sh -->"
  for name in vega vega-lite vega-embed; do
    printf '    <script type="text/javascript">'
    cat "$work"/"$name"-[0-9]*/package/build/"$name".min.js
    echo '</script>'
  done
  echo '    <style>'
  echo '        table {'
  echo '            border-spacing: 15px;'
  echo '        }'
  echo '    </style>'
  echo '</head>'
  echo '<body>'
  echo '    {plot_divs}'
  echo '</body>'
  echo '</html>'
} > "$out"
# DVC fills {scripts} with its CDN tags, {plot_divs} and {refresh_tag} by plain replacement: the inlined code must
# contain none of them (the template above leaves {scripts} out on purpose).
! grep -q '{scripts}' "$out" && [ "$(grep -o '{plot_divs}' "$out" | wc -l)" = 1 ]
echo "$out: $(wc -c < "$out") bytes"
