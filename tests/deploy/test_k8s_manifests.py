"""deploy/k8s manifests and sidecar/Dockerfile, checked without a cluster or a
Docker engine.

Every manifest document is validated against the Kubernetes API schema as the
official ``kubernetes`` Python client models it, strictly: a field the schema
does not have (a misspelling), a value of the wrong type, or a missing required
field fails.  Then what matters for mmmesh is checked: qosd is privileged on
the host network with bpffs, kernel headers and its socket directory mounted;
the sidecar runs unprivileged with probes and limits; the configs embedded in
ConfigMaps are valid mmmesh configs that agree with the containers' ports,
paths and arguments.  The Dockerfile is parsed (instructions only)."""

from __future__ import annotations

import difflib
import inspect
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

# The kubernetes client is a test dependency (pyproject's "test" extra, installed
# by scripts/bootstrap.sh): a missing one is an error, never a skip.
from kubernetes import client  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))


# --------------------------------------------------------------------------
# A strict validator over the client's models
# --------------------------------------------------------------------------
class SchemaError(AssertionError):
    pass


_LIST = re.compile(r"^(?:List|list)\[(.+)\]$")
_DICT = re.compile(r"^(?:Dict|dict)[\[(]\s*str\s*,\s*(.+)[\])]$")
_SCALARS: dict[str, tuple[type, ...]] = {
    "str": (str,), "int": (int,), "bool": (bool,), "float": (float, int),
    "datetime": (str,), "date": (str,),
}


def model_class(api_version: str, kind: str) -> type:
    """``apps/v1`` + ``DaemonSet`` -> ``client.V1DaemonSet``."""
    version = api_version.rpartition("/")[2]
    name = version[0].upper() + version[1:] + kind
    cls = getattr(client, name, None)
    if cls is None:
        raise SchemaError(f"no model for apiVersion {api_version} kind {kind}")
    return cls  # type: ignore[no-any-return]


def validate(value: Any, typ: str, path: str = "$") -> None:
    """Raises SchemaError if ``value`` is not a ``typ`` (an openapi_types string)."""
    if value is None:
        return
    if typ in _SCALARS:
        ok = _SCALARS[typ]
        if isinstance(value, bool) and bool not in ok:
            raise SchemaError(f"{path}: expected {typ}, got a bool")
        if not isinstance(value, ok):
            raise SchemaError(f"{path}: expected {typ}, got {type(value).__name__} {value!r}")
        return
    if typ == "object":  # IntOrString, RawExtension...
        return
    m = _LIST.match(typ)
    if m:
        if not isinstance(value, list):
            raise SchemaError(f"{path}: expected a list, got {type(value).__name__}")
        for i, v in enumerate(value):
            validate(v, m.group(1), f"{path}[{i}]")
        return
    m = _DICT.match(typ)
    if m:
        if not isinstance(value, dict):
            raise SchemaError(f"{path}: expected a map, got {type(value).__name__}")
        for k, v in value.items():
            if not isinstance(k, str):
                raise SchemaError(f"{path}: key {k!r} is not a string")
            validate(v, m.group(1), f"{path}.{k}")
        return
    cls = getattr(client, typ, None)
    if cls is None:
        raise SchemaError(f"{path}: unknown schema type {typ}")
    if not isinstance(value, dict):
        raise SchemaError(f"{path}: expected a {typ} object, got {type(value).__name__}")
    by_json = {j: a for a, j in cls.attribute_map.items()}
    for key, v in value.items():
        attr = by_json.get(key)
        if attr is None:
            near = difflib.get_close_matches(str(key), list(by_json), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise SchemaError(f"{path}: {typ} has no field {key!r}{hint}")
        validate(v, cls.openapi_types[attr], f"{path}.{key}")


def validate_doc(doc: dict[str, Any]) -> Any:
    """Strict schema walk, then the client's own deserialisation (required
    fields and enums it checks on construction).  Returns the model object."""
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        raise SchemaError("a manifest needs apiVersion and kind")
    cls = model_class(doc["apiVersion"], doc["kind"])
    validate(doc, cls.__name__, f"{doc['kind']}/{doc.get('metadata', {}).get('name', '?')}")

    text = json.dumps(doc)
    api = client.ApiClient()
    params = inspect.signature(api.deserialize).parameters
    try:
        if "response_text" in params:  # client >= 32 (openapi-generator 7)
            return api.deserialize(text, cls.__name__, "application/json")

        class Response:  # older clients take a response object
            data = text

        return api.deserialize(Response(), cls.__name__)  # type: ignore[call-arg, arg-type]
    except ValueError as e:  # a required field missing, a bad enum value
        raise SchemaError(f"{doc['kind']}: {e}") from e


def load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def docs_by_kind(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in load(path)}


# --------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------
def test_there_are_manifests() -> None:
    assert {p.name for p in MANIFESTS} >= {"model-pod.yaml", "qosd-daemonset.yaml",
                                           "qosd-daemonset-etcd.yaml"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_matches_the_kubernetes_schema(path: Path) -> None:
    docs = load(path)
    assert docs
    for d in docs:
        validate_doc(d)
        assert d["metadata"]["name"]
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace"), f"{d['kind']} without a namespace"


@pytest.mark.parametrize("mutate, message", [
    (lambda p: p["spec"].__setitem__("hostNetwrok", True), "no field 'hostNetwrok'"),
    (lambda p: p["spec"]["containers"][0].__setitem__("imagePullPolicy", 3), "expected str"),
    (lambda p: p["spec"]["containers"][0]["ports"][0].__setitem__("containerPort", "9000"),
     "expected int"),
    (lambda p: p["spec"]["containers"][0]["resources"].__setitem__("limit", {}),
     "did you mean limits"),
    (lambda p: p["spec"]["containers"][0]["securityContext"].__setitem__("privileged", "no"),
     "expected bool"),
    (lambda p: p["spec"]["containers"][0].pop("name"), "name"),
    (lambda p: p["spec"].__setitem__("volumes", {"a": 1}), "expected a list"),
], ids=["misspelt", "type", "int", "near-miss", "bool", "required", "shape"])
def test_the_validator_refuses_bad_manifests(mutate: Any, message: str) -> None:
    pod = docs_by_kind(K8S / "model-pod.yaml")[("Pod", "vision-encoder")]
    pod = json.loads(json.dumps(pod))
    mutate(pod)
    with pytest.raises(SchemaError, match=message):
        validate_doc(pod)


# --------------------------------------------------------------------------
# qosd DaemonSet
# --------------------------------------------------------------------------
# Every DaemonSet check runs on both variants: gossip (qosd-daemonset.yaml) and
# etcd (qosd-daemonset-etcd.yaml, the same DaemonSet with the etcd back end).
@pytest.fixture(scope="module", params=["qosd-daemonset.yaml", "qosd-daemonset-etcd.yaml"])
def qosd(request: pytest.FixtureRequest) -> dict[tuple[str, str], dict[str, Any]]:
    return docs_by_kind(K8S / request.param)


def _mounts(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in c.get("volumeMounts", [])}


def _volumes(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in spec.get("volumes", [])}


def test_qosd_daemonset_is_privileged_on_the_host_network(qosd: Any) -> None:
    ds = qosd[("DaemonSet", "qosd")]
    spec = ds["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= \
        ds["spec"]["template"]["metadata"]["labels"].items()
    assert spec["hostNetwork"] is True
    assert spec["hostPID"] is True  # report senders are identified by host pid + cgroup
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert {"operator": "Exists"} in spec["tolerations"]  # every node
    (c,) = spec["containers"]
    assert c["securityContext"]["privileged"] is True
    ns = qosd[("Namespace", ds["metadata"]["namespace"])]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_qosd_mounts_bpffs_headers_and_socket_dir(qosd: Any) -> None:
    spec = qosd[("DaemonSet", "qosd")]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    mounts, vols = _mounts(c), _volumes(spec)

    def host(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        m = mounts[path]
        v = vols[m["name"]]
        assert v["hostPath"]["path"] == path, (path, v)
        return m, v

    m, _ = host("/sys/fs/bpf")
    assert m.get("mountPropagation") == "Bidirectional"  # pins outlive the pod
    assert not m.get("readOnly")
    for path in ("/lib/modules", "/usr/src"):  # kernel headers for bcc
        m, v = host(path)
        assert m["readOnly"] is True and v["hostPath"]["type"] == "Directory"
    m, _ = host("/run/mmmesh")
    assert not m.get("readOnly")
    host("/var/lib/mmmesh")
    for m in mounts.values():
        assert m["name"] in vols


def test_qosd_config_and_policy_come_from_the_configmap(qosd: Any) -> None:
    from mmmesh.policy import parse_policy
    from qosd.config import QosdConfig

    ds = qosd[("DaemonSet", "qosd")]
    spec = ds["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    cfg_path = c["command"][c["command"].index("--config") + 1]
    mount = next(m for p, m in _mounts(c).items() if cfg_path.startswith(p + "/"))
    vol = _volumes(spec)[mount["name"]]
    cm = qosd[("ConfigMap", vol["configMap"]["name"])]
    assert cm["metadata"]["namespace"] == ds["metadata"]["namespace"]
    files = {i["path"]: cm["data"][i["key"]] for i in vol["configMap"]["items"]}
    qcfg = QosdConfig.model_validate(yaml.safe_load(files[Path(cfg_path).name]))
    # the socket the sidecars use, in the shared directory; the policy it starts with
    assert str(qcfg.api_socket).startswith("/run/mmmesh/")
    assert str(qcfg.state_dir) in _mounts(c)
    assert qcfg.initial_policy is not None
    assert str(qcfg.initial_policy.parent) == mount["mountPath"]
    policy = parse_policy(yaml.safe_load(files[qcfg.initial_policy.name]))
    assert policy.link.device in qcfg.uplinks
    table = {cl.name: (str(cl.rate), cl.weight) for cl in policy.classes}
    assert table["video"] == ("150mbit", 7) and table["lidar"] == ("80mbit", 5)
    assert table["voice"] == ("1.2mbit", 3)
    # metrics on the declared port (the address: test_qosd_metrics_bind_to_the_node_ip_only)
    port = int(str(qcfg.metrics_addr).rpartition(":")[2])
    assert {"name": "metrics", "containerPort": port, "hostPort": port, "protocol": "TCP"} \
        in c["ports"]
    env = {e["name"]: e for e in c["env"]}
    assert env["MMMESH_QOSD_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_qosd_metrics_bind_to_the_node_ip_only(qosd: Any, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The unauthenticated metrics endpoint listens on the node's IP (downward
    API), never on every address; the file alone would keep it on loopback."""
    from qosd.config import QosdConfig

    ds = qosd[("DaemonSet", "qosd")]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    text = qosd[("ConfigMap", "qosd-config")]["data"]["qosd.yaml"]
    assert str(QosdConfig.model_validate(yaml.safe_load(text)).metrics_addr) \
        .startswith("127.0.0.1:")
    names = [e["name"] for e in c["env"]]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    addr = env["MMMESH_QOSD_METRICS_ADDR"]["value"]
    # $(VAR) expands only variables defined earlier in the list
    assert names.index("NODE_IP") < names.index("MMMESH_QOSD_METRICS_ADDR")
    host, _, port = addr.rpartition(":")
    assert host == "$(NODE_IP)"
    assert {"name": "metrics", "containerPort": int(port), "hostPort": int(port),
            "protocol": "TCP"} in c["ports"]
    assert not any("0.0.0.0" in str(e.get("value", "")) for e in c["env"])
    # what qosd makes of the ConfigMap's file and the expanded variable
    cfg_file = tmp_path / "qosd.yaml"
    cfg_file.write_text(text)
    monkeypatch.setenv("MMMESH_QOSD_CONFIG", str(cfg_file))
    monkeypatch.setenv("MMMESH_QOSD_METRICS_ADDR", addr.replace("$(NODE_IP)", "10.0.3.7"))
    assert QosdConfig().metrics_addr == f"10.0.3.7:{port}"


def test_qosd_probes_and_limits(qosd: Any) -> None:
    (c,) = qosd[("DaemonSet", "qosd")]["spec"]["template"]["spec"]["containers"]
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"),
                        ("readinessProbe", "/readyz")):
        cmd = c[probe]["exec"]["command"]
        assert cmd[0] == "python3" and cmd[-1] == path
        compile(cmd[2], probe, "exec")  # the probe is valid Python
        assert "/run/mmmesh/qosd.sock" in cmd[2]
    # a cold start compiles the programs: the startup probe allows minutes
    sp = c["startupProbe"]
    assert sp["periodSeconds"] * sp["failureThreshold"] >= 90
    assert c["resources"]["limits"]["memory"] == "512Mi"
    assert "cpu" in c["resources"]["requests"]


def test_qosd_etcd_variant_reaches_etcd_with_client_certs_from_a_secret() -> None:
    """The etcd back end: qosd.yaml names the etcd Service's DNS name and port,
    the client certificate, key and CA are files of the Secret's volume, the
    Service is headless (every member's address), and nothing else differs
    from the gossip variant's DaemonSet but that volume."""
    from qosd.config import QosdConfig

    docs = docs_by_kind(K8S / "qosd-daemonset-etcd.yaml")
    ds = docs[("DaemonSet", "qosd")]
    spec = ds["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    cfg = QosdConfig.model_validate(
        yaml.safe_load(docs[("ConfigMap", "qosd-config")]["data"]["qosd.yaml"]))
    assert cfg.peers is None and cfg.cluster is not None and cfg.cluster.backend == "etcd"
    etcd = cfg.cluster.etcd
    assert etcd is not None
    # the Service the endpoints name, in this namespace, on the port they use
    ns = ds["metadata"]["namespace"]
    (endpoint,) = etcd.endpoints
    host, _, port = endpoint.rpartition(":")
    svc_name, svc_ns = host.split(".")[:2]
    svc = docs[("Service", svc_name)]
    assert svc_ns == ns == svc["metadata"]["namespace"]
    assert host in (f"{svc_name}.{ns}.svc", f"{svc_name}.{ns}.svc.cluster.local")
    assert svc["spec"]["clusterIP"] == "None"  # headless: every member, not one VIP
    assert int(port) in {p["port"] for p in svc["spec"]["ports"]}
    assert etcd.server_name and etcd.server_name.startswith(f"{svc_name}.{ns}")
    # certificates: files of the Secret's volume, read-only, private key not world-readable
    mounts, vols = _mounts(c), _volumes(spec)
    files = [etcd.cert_file, etcd.key_file, etcd.ca_file]
    assert all(f is not None for f in files)
    (mount,) = {str(f.parent) for f in files if f is not None}
    m = mounts[mount]
    assert m["readOnly"] is True
    secret = vols[m["name"]]["secret"]
    assert secret["defaultMode"] & 0o077 == 0
    assert {i["path"] for i in secret["items"]} == {f.name for f in files if f is not None}
    # otherwise the gossip variant's DaemonSet
    gossip = docs_by_kind(K8S / "qosd-daemonset.yaml")[("DaemonSet", "qosd")]
    g_spec = json.loads(json.dumps(gossip["spec"]["template"]["spec"]))
    e_spec = json.loads(json.dumps(spec))
    e_spec["volumes"] = [v for v in e_spec["volumes"] if v["name"] != m["name"]]
    e_spec["containers"][0]["volumeMounts"].remove(m)
    assert e_spec == g_spec


# --------------------------------------------------------------------------
# Model pod
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model() -> dict[tuple[str, str], dict[str, Any]]:
    return docs_by_kind(K8S / "model-pod.yaml")


def _containers(model: Any) -> dict[str, dict[str, Any]]:
    pod = model[("Pod", "vision-encoder")]
    return {c["name"]: c for c in pod["spec"]["containers"]}


def test_model_pod_has_sidecar_and_model_server(model: Any) -> None:
    cs = _containers(model)
    assert set(cs) == {"sidecar", "model-server"}
    assert "sidecar" in cs["sidecar"]["image"]
    for name, c in cs.items():
        lim = c["resources"]["limits"]
        assert "cpu" in lim and "memory" in lim, name
        assert "readinessProbe" in c and "livenessProbe" in c, name
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert c["securityContext"]["runAsNonRoot"] is True, name
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], name
        assert not c["securityContext"].get("privileged"), name
    pod = model[("Pod", "vision-encoder")]
    assert not pod["spec"].get("hostNetwork")
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_sidecar_config_agrees_with_the_pod(model: Any) -> None:
    from sidecar.config import SidecarConfig

    pod = model[("Pod", "vision-encoder")]
    cs = _containers(model)
    sc = cs["sidecar"]
    cfg_path = sc["args"][sc["args"].index("--config") + 1]
    mounts = _mounts(sc)
    mount = mounts[str(Path(cfg_path).parent)]
    assert mount["readOnly"] is True
    vol = _volumes(pod["spec"])[mount["name"]]
    cm = model[("ConfigMap", vol["configMap"]["name"])]
    assert cm["metadata"]["namespace"] == pod["metadata"]["namespace"]
    key = next(i["key"] for i in vol["configMap"]["items"] if i["path"] == Path(cfg_path).name)
    cfg = SidecarConfig.model_validate(yaml.safe_load(cm["data"][key]))

    ports = {p["name"]: p for p in sc["ports"]}
    assert cfg.listen.tcp and int(cfg.listen.tcp.rpartition(":")[2]) == \
        ports["mmh"]["containerPort"]
    assert sc["readinessProbe"]["tcpSocket"]["port"] == "mmh"
    assert cfg.metrics_addr and int(cfg.metrics_addr.rpartition(":")[2]) == \
        ports["metrics"]["containerPort"]
    assert sc["livenessProbe"]["httpGet"]["port"] == "metrics"
    # the runner talks to the model-server container on localhost
    ms_ports = {p["name"]: p["containerPort"] for p in cs["model-server"]["ports"]}
    assert cfg.runner.kind == "kserve-rest"
    assert cfg.runner.target == f"http://127.0.0.1:{ms_ports['http']}"
    # qosd's report-only socket from the node, read-only
    assert cfg.qosd.socket is not None
    from qosd.config import QosdConfig

    qosd_docs = docs_by_kind(K8S / "qosd-daemonset.yaml")
    qcfg = QosdConfig.model_validate(
        yaml.safe_load(qosd_docs[("ConfigMap", "qosd-config")]["data"]["qosd.yaml"]))
    assert cfg.qosd.socket == qcfg.sla_socket != qcfg.api_socket
    qrun = mounts[str(cfg.qosd.socket.parent)]
    assert qrun["readOnly"] is True
    assert _volumes(pod["spec"])[qrun["name"]]["hostPath"]["path"] == str(cfg.qosd.socket.parent)
    # the Service reaches the pod's MMH port
    svc = model[("Service", "vision-encoder")]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)


def test_model_server_probes_use_the_kserve_health_endpoints(model: Any) -> None:
    ms = _containers(model)["model-server"]
    assert ms["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert ms["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"


# --------------------------------------------------------------------------
# Dockerfile (parsed; no engine here)
# --------------------------------------------------------------------------
def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined, comments and
    parser directives dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # comment inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, "dangling line continuation"
    return out


def test_dockerfile() -> None:
    path = ROOT / "sidecar" / "Dockerfile"
    ins = dockerfile_instructions(path.read_text())
    words = [w for w, _ in ins]
    known = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
             "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}
    assert set(words) <= known, set(words) - known
    args = {a.split("=")[0]: a.partition("=")[2] for w, a in ins if w == "ARG"}
    froms = [i for i, (w, _) in enumerate(ins) if w == "FROM"]
    final = ins[froms[-1]:]
    base = final[0][1].split()[0]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), base)
    assert base.startswith("debian:") and base.endswith("-slim"), base

    users = [a for w, a in final if w == "USER"]
    assert users, "the final stage sets no USER (it would run as root)"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and (not user.isdigit() or int(user) >= 1000), user

    (entry,) = [a for w, a in final if w == "ENTRYPOINT"]
    entry_argv = json.loads(entry)  # exec form: signals reach the sidecar (graceful drain)
    assert entry_argv == ["mmmesh-sidecar"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["mmmesh-sidecar"] == "sidecar.main:main"

    (cmd,) = [a for w, a in final if w == "CMD"]
    cmd_argv = json.loads(cmd)
    # the default config path is where the model pod mounts it
    pod = docs_by_kind(K8S / "model-pod.yaml")[("Pod", "vision-encoder")]
    sc = next(c for c in pod["spec"]["containers"] if c["name"] == "sidecar")
    assert cmd_argv == sc["args"]

    # what is copied from the build context exists (and is let through the dockerignore)
    for w, a in ins:
        if w == "COPY" and "--from=" not in a:
            *srcs, _dst = shlex.split(a)
            for s in srcs:
                assert (ROOT / s).exists(), s
    ignore = (ROOT / "sidecar" / "Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*") + 1:]  # everything is excluded but what is listed
    for needed in ("pyproject.toml", "README.md", "mmmesh/", "qosd/", "sidecar/"):
        assert f"!{needed}" in ignore
    # the runtime image gets no compiler or package cache
    final_runs = " ".join(a for w, a in final if w == "RUN")
    assert "rm -rf /var/lib/apt/lists/*" in final_runs
    assert not re.search(r"\b(gcc|build-essential|clang)\b", final_runs)


def test_qosd_dockerfile() -> None:
    """The DaemonSet's image: Debian's bcc in a --system-site-packages venv, the
    BPF sources where the loader finds them, qosd as PID 1 in exec form."""
    ins = dockerfile_instructions((ROOT / "qosd" / "Dockerfile").read_text())
    text = " ".join(a for _, a in ins)
    assert ins[0][0] == "FROM" and ins[0][1].startswith("debian:bookworm")
    assert "python3-bpfcc" in text and "--system-site-packages" in text
    assert "MMMESH_BPF_DIR=/opt/mmmesh/bpf" in text and "COPY bpf ./bpf" in " ".join(
        f"{w} {a}" for w, a in ins)
    (entry,) = [a for w, a in ins if w == "ENTRYPOINT"]
    assert json.loads(entry) == ["/opt/mmmesh/.venv/bin/qosd"]
    ds = (ROOT / "deploy" / "k8s" / "qosd-daemonset.yaml").read_text()
    assert "mmmesh/qosd:0.1.0" in ds
