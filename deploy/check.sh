#!/usr/bin/env bash
# Validate everything under deploy/ that a tool can check:
#   - prometheus/prometheus.yml with `promtool check config` (which also loads alerts.yml),
#   - prometheus/alerts.yml and recording.yml with `promtool check rules` and their unit tests
#     (`promtool test rules`),
#   - grafana/kvgate-dashboard.json is valid JSON with panels and queries,
#   - the Helm chart renders (Helm's own engine, helm/render.py) exactly to k8s/, lints clean, and
#     renders with every option on.
# Usage: deploy/check.sh           check (CI: tests/deploy_check.rs runs this)
#        deploy/check.sh --write   re-render deploy/k8s/ from the chart, then check
# Python: $KVGATE_PYTHON (else python3) with helm-python-sdk installed (.ci/requirements.txt).
# Exit: 0 all checked and fine; 1 a check failed; 77 nothing failed but a tool was missing
# (printed as "skipped: ..."; the Rust test fails on that under CI).
set -uo pipefail
cd "$(dirname "$0")"
py=${KVGATE_PYTHON:-python3}
failed=0
missing=()
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [[ ${1:-} == --write ]]; then
  "$py" helm/render.py write || exit 1
fi

if command -v promtool >/dev/null 2>&1; then
  major=$(promtool --version 2>&1 | sed -nE '1s/.*version ([0-9]+)\..*/\1/p')
  cp prometheus/prometheus.yml prometheus/alerts.yml prometheus/recording.yml "$tmp/"
  if [[ ${major:-0} -lt 3 ]]; then
    # scrape_protocols (2.49+) and fallback_scrape_protocol (3.0+) are unknown to older promtool;
    # check the rest of the file as Prometheus 2.x would load it.
    echo "note: promtool ${major}.x: checking prometheus.yml without scrape_protocols/fallback_scrape_protocol (Prometheus 3 keys)"
    sed -i -E '/^[[:space:]]*(scrape_protocols|fallback_scrape_protocol):/d' "$tmp/prometheus.yml"
  fi
  promtool check config "$tmp/prometheus.yml" || failed=1
  promtool check rules prometheus/alerts.yml prometheus/recording.yml || failed=1
  (cd prometheus && promtool test rules alerts_test.yml recording_test.yml) || failed=1
else
  missing+=("promtool (Debian package prometheus)")
fi

if "$py" - grafana/kvgate-dashboard.json <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
panels = [p for p in d["panels"] if p.get("type") != "row"]
exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
assert d.get("uid") and d.get("title"), "dashboard needs uid and title"
assert len(panels) >= 10 and all(p.get("targets") for p in panels), "every panel needs a query"
ids = [p["id"] for p in d["panels"]]
assert len(ids) == len(set(ids)), "duplicate panel ids"
print(f"dashboard OK: {len(panels)} panels, {len(exprs)} queries")
PYEOF
then :; else failed=1; fi

"$py" helm/render.py check
case $? in
  0) ;;
  77) missing+=("helm_python for $py (pip install helm-python-sdk)") ;;
  *) failed=1 ;;
esac

if [[ $failed -ne 0 ]]; then
  echo "deploy/check.sh: FAILED"
  exit 1
fi
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "skipped: missing ${missing[*]}"
  exit 77
fi
echo "deploy/check.sh: all checks passed"
