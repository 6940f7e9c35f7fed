#!/usr/bin/env python3
"""Render the kvgate Helm chart with Helm's own template engine and compare it with deploy/k8s/.

Helm is not packaged for Debian, so this uses the `helm-python-sdk` wheel (PyPI), which bundles
Helm's official Go SDK (v4) as a shared library: the rendering is Helm's, not an imitation.

    render.py check   # exit 1 (with a diff) when deploy/k8s/ differs from the chart's defaults
    render.py write   # re-render deploy/k8s/ from the chart's defaults
Exit 77 when helm_python is not importable (deploy/check.sh turns that into skip or failure).

Besides the default render, `check` also renders the chart with every option switched on
(helm/ci-values-all.yaml), parses every document of both renders as YAML, and runs `helm lint`.
"""
import difflib
import pathlib
import sys

try:
    import helm_python as helm
except ImportError:
    print("skipped: helm_python (pip install helm-python-sdk) is not importable by " + sys.executable)
    sys.exit(77)

HERE = pathlib.Path(__file__).resolve().parent
CHART = HERE / "kvgate"
OUT = HERE.parent / "k8s"
RELEASE = "kvgate"
HEADER = (
    "# Rendered from deploy/helm/kvgate ({src}, release {rel}) by `deploy/check.sh --write`.\n"
    "# Do not edit: change the chart and re-render (CI fails when these drift).\n"
)


def render(values=None):
    """Template path -> rendered text, without empty documents (disabled optional templates)."""
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values or {}, name=RELEASE, namespace="default")
    docs = {}
    for path, text in out.items():
        if not path.endswith(".yaml"):
            continue  # NOTES.txt, helpers
        text = "\n".join(line.rstrip() for line in text.strip().splitlines()) + "\n"
        if text.strip():
            docs[pathlib.PurePosixPath(path).name] = text
    return docs


def parse_all(docs, what):
    kinds = []
    for name, text in sorted(docs.items()):
        try:
            obj = helm.values_from_yaml(text)
        except Exception as e:  # noqa: BLE001 — report any parser failure with its file
            sys.exit(f"{what}: {name} is not valid YAML: {e}")
        if not isinstance(obj, dict) or "kind" not in obj or "apiVersion" not in obj:
            sys.exit(f"{what}: {name} is not a Kubernetes object")
        kinds.append(obj["kind"])
    return kinds


def expected():
    return {name: HEADER.format(src="default values", rel=RELEASE) + text for name, text in render().items()}


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "check"
    want = expected()
    if mode == "write":
        OUT.mkdir(exist_ok=True)
        for old in OUT.glob("*.yaml"):
            if old.name not in want:
                old.unlink()
        for name, text in want.items():
            (OUT / name).write_text(text)
        print(f"wrote {len(want)} manifests to {OUT}")
        return
    if mode != "check":
        sys.exit(f"usage: {sys.argv[0]} check|write")

    failures = 0
    have = {p.name: p.read_text() for p in OUT.glob("*.yaml")}
    for name in sorted(set(want) | set(have)):
        a, b = have.get(name, ""), want.get(name, "")
        if a != b:
            failures += 1
            sys.stdout.writelines(
                difflib.unified_diff(a.splitlines(True), b.splitlines(True), f"deploy/k8s/{name}", f"chart render/{name}")
            )
    if failures:
        print(f"\ndeploy/k8s/ drifted from the chart in {failures} file(s): run deploy/check.sh --write")
        sys.exit(1)

    default_kinds = parse_all(render(), "default render")
    all_on = helm.values_from_yaml((HERE / "ci-values-all.yaml").read_text())
    full = render(all_on)
    full_kinds = parse_all(full, "all-options render")
    for k in ("ServiceMonitor", "PodMonitor"):
        if k not in full_kinds:
            sys.exit(f"all-options render lacks a {k}")
    dep = full["deployment.yaml"]
    if "scheme: HTTPS" in render()["deployment.yaml"]:
        sys.exit("default render: probes must use plain HTTP without TLS")
    for needle in ("KVGATE_ADMIN_KEY", "KVGATE_API_KEYS", "/etc/kvgate-tls", "containerPort: 9091", "scheme: HTTPS"):
        if needle not in dep:
            sys.exit(f"all-options render: deployment lacks {needle!r}")
    if "[server.tls]" not in full["configmap.yaml"]:
        sys.exit("all-options render: config lacks [server.tls]")
    # EPP mode watching its InferencePool: RBAC to read pods and inferencepools, the service
    # account's token mounted, and the pool entry in the config (valid TOML).
    if "Role" not in full_kinds or "RoleBinding" not in full_kinds:
        sys.exit("all-options render (epp.inferencePool.watch): no Role/RoleBinding")
    role = helm.values_from_yaml(full["role.yaml"])
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): sorted(r["verbs"]) for r in role["rules"]}
    for key in ((("",), ("pods",)), (("inference.networking.k8s.io",), ("inferencepools",))):
        if rules.get(key) != ["get", "list", "watch"]:
            sys.exit(f"all-options render: Role must allow get/list/watch on {key}: {rules}")
    binding = helm.values_from_yaml(full["rolebinding.yaml"])
    sa = helm.values_from_yaml(full["serviceaccount.yaml"])
    if binding["roleRef"]["name"] != role["metadata"]["name"] or binding["subjects"][0]["name"] != sa["metadata"]["name"]:
        sys.exit("all-options render: the RoleBinding does not bind the Role to kvgate's service account")
    if "automountServiceAccountToken: true" not in dep or sa.get("automountServiceAccountToken") is not True:
        sys.exit("all-options render: the watch needs the service account token mounted")
    if "automountServiceAccountToken: false" not in render()["deployment.yaml"] or "Role" in default_kinds:
        sys.exit("default render: no Kubernetes API access without epp.inferencePool.watch")
    import tomllib
    toml_text = helm.values_from_yaml(full["configmap.yaml"])["data"]["kvgate.toml"]
    pools = tomllib.loads(toml_text).get("worker_pools", [])
    pool = helm.values_from_yaml(full["inferencepool.yaml"])
    if not any(p.get("inference_pool") == pool["metadata"]["name"] and p.get("models") == ["llama-8b"] for p in pools):
        sys.exit(f"all-options render: config lacks the InferencePool's [[worker_pools]] entry: {pools}")
    # The prefill/decode example values render, and their config reaches the ConfigMap.
    pd = render(helm.values_from_yaml((HERE / "pd-values.yaml").read_text()))
    parse_all(pd, "pd-values render")
    if 'role = "prefill"' not in pd["configmap.yaml"] or "[pd]" not in pd["configmap.yaml"]:
        sys.exit("pd-values render: config lacks the [pd] table or the prefill pool")
    # Misconfigurations the chart must refuse rather than render.
    for bad, why in (({"admin": {"enabled": True}}, "admin without secret"), ({"tls": {"enabled": True}}, "tls without secret")):
        try:
            render(bad)
        except Exception:  # noqa: BLE001 — any render error is the refusal we want
            continue
        sys.exit(f"chart rendered despite {why}")

    lint = helm.lint(str(CHART))
    errors = [m for m in lint.get("messages", []) if m.get("severity", 0) >= 3] + list(lint.get("errors") or [])
    if errors:
        sys.exit(f"helm lint: {errors}")
    print(f"chart OK: deploy/k8s matches ({', '.join(sorted(default_kinds))}); all-options render: {len(full_kinds)} objects; lint clean")


if __name__ == "__main__":
    main()
