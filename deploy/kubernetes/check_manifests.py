"""Cross-document checks of the kvroute manifests that no per-object schema can make.

The schemas (kubernetes-validate, run by validate.sh) prove each object is well formed. This
proves the objects fit together the way peer discovery needs: the peer selector names the
headless internal Service, whose "internal" port reaches the container's internal port; the
pods run as a ServiceAccount whose Role may watch EndpointSlices and pods; the downward API
gives the pod its own identity; probes and rollout settings are the ones the bootstrap design
relies on. Usage: check_manifests.py FILE... ; exit 1 with one line per problem.
"""

import sys

import yaml

PEER_SELECTOR_FLAG = "--kv-peer-selector="
PEER_PORT_NAME_FLAG = "--kv-peer-port-name="
TOKEN_FILE_FLAG = "--internal-auth-token-file="
DEFAULT_PEER_PORT_NAME = "internal"


def load(paths):
    docs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for doc in yaml.safe_load_all(f):
                if doc is not None:
                    docs.append(doc)
    return docs


def one(docs, kind, problems, name=None):
    found = [d for d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]
    if len(found) != 1:
        problems.append(f"expected exactly one {kind}{' ' + name if name else ''}, found {len(found)}")
        return None
    return found[0]


def flag(args, prefix):
    values = [a[len(prefix):] for a in args if a.startswith(prefix)]
    return values[0] if len(values) == 1 else None


def labels_match(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def grants(role, group, resource, verbs):
    for rule in role.get("rules", []):
        if group in rule.get("apiGroups", []) and resource in rule.get("resources", []):
            if set(verbs) <= set(rule.get("verbs", [])):
                return True
    return False


def check(docs):
    problems = []
    ns = one(docs, "Namespace", problems)
    dep = one(docs, "Deployment", problems)
    if ns is None or dep is None:
        return problems
    namespace = ns["metadata"]["name"]
    for d in docs:
        if d["kind"] != "Namespace" and d["metadata"].get("namespace") != namespace:
            problems.append(f"{d['kind']} {d['metadata']['name']} is not in namespace {namespace}")

    spec = dep["spec"]
    pod = spec["template"]["spec"]
    pod_labels = spec["template"]["metadata"].get("labels", {})
    if not labels_match(spec["selector"].get("matchLabels"), pod_labels):
        problems.append("Deployment selector does not match its pod template labels")
    if spec.get("replicas") != 3:
        problems.append("Deployment must run 3 replicas")
    rolling = spec.get("strategy", {}).get("rollingUpdate", {})
    if spec.get("strategy", {}).get("type") != "RollingUpdate" or rolling.get("maxSurge") != 2 or rolling.get("maxUnavailable") != 0:
        problems.append("rollout must be RollingUpdate surge-only: maxSurge 2, maxUnavailable 0")

    containers = pod.get("containers", [])
    if len(containers) != 1:
        problems.append("expected one router container")
        return problems
    c = containers[0]
    args = c.get("args", [])
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    if ports.get("http") != 8080 or ports.get("internal") != 8081:
        problems.append(f"container ports must be http 8080 and internal 8081, got {ports}")

    env = {e["name"]: e for e in c.get("env", [])}
    for var, field in (("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace"), ("POD_IP", "status.podIP")):
        got = env.get(var, {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if got != field:
            problems.append(f"env {var} must come from the downward API field {field}, got {got}")

    ready = c.get("readinessProbe", {})
    if ready.get("httpGet", {}).get("path") != "/readyz" or ready.get("periodSeconds") != 2 or ready.get("failureThreshold") != 30:
        problems.append("readiness must be GET /readyz, period 2 s, failureThreshold 30")
    if c.get("livenessProbe", {}).get("httpGet", {}).get("path") != "/healthz":
        problems.append("liveness must be GET /healthz")
    for probe in (ready, c.get("livenessProbe", {})):
        port = probe.get("httpGet", {}).get("port")
        if port is not None and port not in ports and port not in ports.values():
            problems.append(f"probe port {port!r} is not a container port")

    selector = flag(args, PEER_SELECTOR_FLAG)
    if selector is None:
        problems.append(f"router args need exactly one {PEER_SELECTOR_FLAG}")
    else:
        key, _, service_name = selector.partition("=")
        if key != "kubernetes.io/service-name" or not service_name:
            problems.append(f"peer selector {selector!r} must be kubernetes.io/service-name=<Service>")
        svc = one(docs, "Service", problems, service_name)
        if svc is not None:
            port_name = flag(args, PEER_PORT_NAME_FLAG) or DEFAULT_PEER_PORT_NAME
            if svc["spec"].get("clusterIP") != "None":
                problems.append(f"peer Service {service_name} must be headless (clusterIP: None)")
            if not labels_match(svc["spec"].get("selector"), pod_labels):
                problems.append(f"peer Service {service_name} does not select the router pods")
            svc_ports = {p.get("name"): p for p in svc["spec"].get("ports", [])}
            if port_name not in svc_ports:
                problems.append(f"peer Service {service_name} has no port named {port_name!r}")
            else:
                target = svc_ports[port_name].get("targetPort")
                if target not in ports and target not in ports.values():
                    problems.append(f"peer Service port {port_name} targets {target!r}, not a container port")
    public = [s for s in docs if s["kind"] == "Service" and s["spec"].get("clusterIP") != "None"]
    if not any(labels_match(s["spec"].get("selector"), pod_labels) and any(p.get("port") == 8080 for p in s["spec"].get("ports", [])) for s in public):
        problems.append("no public Service on port 8080 selects the router pods")

    sa_name = pod.get("serviceAccountName")
    one(docs, "ServiceAccount", problems, sa_name)
    bound_roles = [
        b["roleRef"]["name"]
        for b in docs
        if b["kind"] == "RoleBinding"
        and b["roleRef"]["kind"] == "Role"
        and any(s.get("kind") == "ServiceAccount" and s.get("name") == sa_name and s.get("namespace") == namespace for s in b.get("subjects", []))
    ]
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] in bound_roles]
    verbs = ["get", "list", "watch"]
    if not any(grants(r, "discovery.k8s.io", "endpointslices", verbs) for r in roles):
        problems.append(f"ServiceAccount {sa_name} may not get/list/watch endpointslices.discovery.k8s.io")
    if not any(grants(r, "", "pods", verbs) for r in roles):
        problems.append(f"ServiceAccount {sa_name} may not get/list/watch pods")

    token_file = flag(args, TOKEN_FILE_FLAG)
    if token_file is None:
        problems.append(f"router args need exactly one {TOKEN_FILE_FLAG}")
    else:
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounted = False
        for m in c.get("volumeMounts", []):
            secret = volumes.get(m["name"], {}).get("secret")
            if secret and token_file.startswith(m["mountPath"].rstrip("/") + "/"):
                rel = token_file[len(m["mountPath"].rstrip("/")) + 1:]
                items = secret.get("items")
                if m.get("readOnly") and (items is None or any(i["path"] == rel for i in items)):
                    mounted = True
        if not mounted:
            problems.append(f"{token_file} is not a file of a read-only Secret volume mount")
    return problems


def main(paths):
    problems = check(load(paths))
    for p in problems:
        print(f"ERROR manifests: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
