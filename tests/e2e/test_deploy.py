"""``deploy/``: the image, the KubeRay manifests and the cluster-launcher config are parsed and
cross-checked, every ``profd`` command the deploy files and the docs show must exist, and the
KubeRay head's start script is run for real against the test session's Ray."""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from deploy_files import (
    DEPLOY,
    DOCKERFILE,
    MARKDOWN,
    ROOT,
    cli_spec,
    command_errors,
    commands_in_line,
    dockerfile_instructions,
    documented_commands,
    load_all,
    markdown_commands,
    markdown_lines,
)

from helpers import AUTH, TOKEN, wait_until

KUBERAY = DEPLOY / "kuberay"
LAUNCHER = DEPLOY / "cluster-launcher" / "profd.yaml"
TEMPLATE_TOKEN = "REPLACE_WITH_A_RANDOM_TOKEN"


def by_kind(path: Path) -> dict[str, dict[str, Any]]:
    docs = load_all(path)
    kinds = {d["kind"]: d for d in docs}
    assert len(kinds) == len(docs), f"{path}: one document per kind"
    return kinds


def head_container(cluster_spec: dict[str, Any]) -> dict[str, Any]:
    (container,) = cluster_spec["headGroupSpec"]["template"]["spec"]["containers"]
    return container


def head_script(cluster_spec: dict[str, Any]) -> str:
    (script,) = head_container(cluster_spec)["args"]
    return script


def test_every_profd_command_in_deploy_docs_and_examples_exists() -> None:
    spec = cli_spec()
    found = documented_commands()
    errors = [
        f"{src}: profd {' '.join(tok)}: {e}"
        for src, tok in found
        for e in command_errors(tok, spec)
    ]
    assert errors == []
    files = {src for src, _ in found}
    assert {
        "deploy/kuberay/raycluster.yaml",
        "deploy/kuberay/rayjob.yaml",
        "deploy/cluster-launcher/profd.yaml",
        "deploy/docker/Dockerfile",
        *(str(p.relative_to(ROOT)) for p in MARKDOWN),
    } <= files
    assert {"README.md", "deploy/README.md", "docs/multinode.md", "docs/verl.md"} <= {
        str(p.relative_to(ROOT)) for p in MARKDOWN
    }
    used = {tok[0] for _, tok in found if tok and not tok[0].startswith("-")}
    assert {"up", "down", "status", "profile", "traces", "summarize"} <= used
    assert len(found) >= 30


def test_the_command_check_catches_drift() -> None:
    """The checker itself: misspelt flags, unknown subcommands, and what is not a command."""
    spec = cli_spec()

    def errors(line: str) -> list[str]:
        return [e for tok in commands_in_line(line) for e in command_errors(tok, spec)]

    assert errors("profd up --adress auto && sleep 1") == ["up has no option --adress"]
    assert errors("x; profd upp") == ["no subcommand 'upp'"]
    assert errors("profd profile --next-steps 2 --all-ranks --wait | tee x --bogus") == []
    assert errors("profd sessions | profd traces [--session ID] [--dowload DIR]") == [
        "traces has no option --dowload"
    ]
    assert errors("profd summarize <session-id | dir> [--json] [--top 10]") == []
    assert errors("profd --help > /dev/null") == []
    assert errors("cp /opt/profd/x . ; import profd; profd.attach(role)") == []


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_profd_command_in_the_markdown_exists(path: Path) -> None:
    """Each page on its own: the commands it quotes (fenced blocks and inline code) use only
    subcommands and options the CLI has, and the page is really read (it quotes some)."""
    spec = cli_spec()
    found = markdown_commands(path)
    assert found, f"{path.relative_to(ROOT)}: no profd command found"
    errors = [f"profd {' '.join(tok)}: {e}" for tok in found for e in command_errors(tok, spec)]
    assert errors == []


def test_the_markdown_reader_finds_every_kind_of_command() -> None:
    """Fenced blocks (comments too), inline code, and inline code broken over two lines."""
    spec = cli_spec()
    page = "\n".join(
        [
            "Run `profd up --adress auto` and then `profd",
            "  status --jsn`; prose about profd --nothing is no command.",
            "",
            "```bash",
            "profd profile --next-step 2   # or `profd traces --downlod DIR`",
            "```",
            "| a | `profd summarize <dir> --json` |",
        ]
    )
    errors = [
        e
        for ln in markdown_lines(page)
        for tok in commands_in_line(ln)
        for e in command_errors(tok, spec)
    ]
    assert errors == [
        "up has no option --adress",
        "status has no option --jsn",
        "profile has no option --next-step",
        "traces has no option --downlod",
    ]


def test_the_docs_show_how_an_operator_allows_uploads_and_save_paths() -> None:
    """Over HTTP an upload_uri needs `profd up --allow-upload-prefix` and a save_path outside
    the save root `--allow-save-root` (api/security.py): the pages that use them say so."""
    shown = {
        str(path.relative_to(ROOT)): {
            t.split("=")[0] for tok in markdown_commands(path) if tok[:1] == ["up"] for t in tok
        }
        for path in MARKDOWN
    }
    assert "--allow-upload-prefix" in shown["docs/multinode.md"]
    assert "--allow-save-root" in shown["docs/multinode.md"]
    assert "--allow-save-root" in shown["docs/verl.md"]
    assert "--allow-upload-prefix" in shown["deploy/README.md"]
    # a sidecar reached by another name than loopback or the bind address needs --allow-host
    assert "--allow-host" in shown["deploy/README.md"]


def test_every_manifest_parses() -> None:
    """Every YAML file in deploy/ and examples/ loads, each with the kinds it should hold."""
    kinds = {
        "kuberay/raycluster.yaml": ["RayCluster", "Service"],
        "kuberay/rayjob.yaml": ["RayJob", "Service"],
        "kuberay/secret.yaml": ["Secret"],
    }
    found = sorted(str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*.y*ml"))
    assert found == sorted([*kinds, "cluster-launcher/profd.yaml"])
    for name, expected in kinds.items():
        docs = load_all(DEPLOY / name)
        assert [d["kind"] for d in docs] == expected
        assert all(d["apiVersion"] and d["metadata"]["name"] for d in docs)
    assert yaml.safe_load(LAUNCHER.read_text())["cluster_name"] == "profd"
    for path in (ROOT / "examples").glob("*.y*ml"):
        assert isinstance(yaml.safe_load(path.read_text()), dict), path
    assert dockerfile_instructions()[0][0] == "ARG"


# -- KubeRay ------------------------------------------------------------------------------------
def up_line(script: str) -> list[str]:
    """The tokens after ``profd up`` in the head's script."""
    (line,) = [ln for ln in script.splitlines() if ln.strip().startswith("profd up")]
    return shlex.split(line.split("&&")[0])[2:]


def up_flags(script: str) -> dict[str, list[str]]:
    """Each option of the head's ``profd up`` line with its values (repeatable ones: several)."""
    tokens = [t for t in up_line(script) if t != "$PROFD_UP_ARGS"]  # the operator's extra flags
    flags: dict[str, list[str]] = {}
    for name, value in zip(tokens[::2], tokens[1::2], strict=True):
        flags.setdefault(name, []).append(value)
    return flags


def env_values(container: dict[str, Any]) -> dict[str, Any]:
    """A container's environment: plain values, or the ``valueFrom`` source."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def assert_service_names_allowed(cluster_spec: dict[str, Any], service: dict[str, Any]) -> None:
    """The head's `profd up` allows the Service's DNS names in the Host header (the sidecar
    refuses any other name): the Service named in the pod's environment, its namespace from
    the downward API."""
    env = env_values(head_container(cluster_spec))
    assert env["PROFD_SERVICE"] == service["metadata"]["name"]
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert up_flags(head_script(cluster_spec))["--allow-host"] == [
        "$svc",
        "$svc.$ns",
        "$svc.$ns.svc",
        "$svc.$ns.svc.cluster.local",
    ]


def test_kuberay_raycluster_head_runs_the_sidecar_behind_a_service() -> None:
    docs = by_kind(KUBERAY / "raycluster.yaml")
    cluster, service = docs["RayCluster"], docs["Service"]
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    spec = cluster["spec"]
    head = head_container(spec)
    script = head_script(spec)
    assert head["command"] == ["/bin/bash", "-lc", "--"]
    assert script.strip().splitlines()[-1].strip() == "$KUBERAY_GEN_RAY_START_CMD"
    flags = {k: v[-1] for k, v in up_flags(script).items()}
    assert flags["--address"] == "auto" and flags["--host"] == "0.0.0.0"
    assert_service_names_allowed(spec, service)
    # the operator's extra flags (--allow-upload-prefix, ...): an empty variable, appended
    assert up_line(script)[-1] == "$PROFD_UP_ARGS"
    assert env_values(head)["PROFD_UP_ARGS"] == ""
    up_options = cli_spec()["up"]
    for manifest in ("raycluster.yaml", "rayjob.yaml"):
        named = set(re.findall(r"--allow-[a-z-]+", (KUBERAY / manifest).read_text()))
        assert {"--allow-upload-prefix", "--allow-save-root", "--allow-host"} <= named
        assert named <= up_options
    # KubeRay passes rayStartParams as strings; a YAML number or bool there is rejected
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
    for group in spec["workerGroupSpecs"]:  # the annotation applies to every pod
        (worker,) = group["template"]["spec"]["containers"]
        assert "$KUBERAY_GEN_RAY_START_CMD" in worker["args"][-1]
        assert worker["image"] == head["image"]  # the agent runs inside the workers
    # the Service reaches the sidecar: selector matches the head pod, port is profd up's port
    labels = spec["headGroupSpec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    named = {p["name"]: p["containerPort"] for p in head["ports"]}
    target = port["targetPort"]
    assert named.get(target, target) == int(flags["--port"]) == port["port"]


def test_kuberay_token_comes_from_the_secret() -> None:
    secret = by_kind(KUBERAY / "secret.yaml")["Secret"]
    assert secret["type"] == "Opaque"
    (key,) = secret["stringData"]
    assert secret["stringData"][key] == TEMPLATE_TOKEN
    for manifest, kind in (("raycluster.yaml", "RayCluster"), ("rayjob.yaml", "RayJob")):
        obj = by_kind(KUBERAY / manifest)[kind]
        spec = obj["spec"] if kind == "RayCluster" else obj["spec"]["rayClusterSpec"]
        pod = spec["headGroupSpec"]["template"]["spec"]
        head = head_container(spec)
        (volume,) = [v for v in pod["volumes"] if v.get("secret")]
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        (item,) = volume["secret"]["items"]
        assert item["key"] == key
        (mount,) = [m for m in head["volumeMounts"] if m["name"] == volume["name"]]
        token_file = f"{mount['mountPath']}/{item['path']}"
        script = head_script(spec)
        # profd reads <PROFD_STATE_DIR>/token: the script copies the Secret's file there
        assert f'install -m 600 {token_file} "$PROFD_STATE_DIR/token"' in script
        assert f"grep -q {TEMPLATE_TOKEN} {token_file}" in script
        env = env_values(head)
        assert env["PROFD_STATE_DIR"].startswith("/")
        assert volume["secret"]["defaultMode"] & 0o040 and pod["securityContext"]["fsGroup"] == 100


def test_kuberay_rayjob_runs_the_ray_train_example_on_the_same_head() -> None:
    docs = by_kind(KUBERAY / "rayjob.yaml")
    job, service = docs["RayJob"], docs["Service"]
    cluster = by_kind(KUBERAY / "raycluster.yaml")["RayCluster"]
    spec = job["spec"]["rayClusterSpec"]
    assert head_script(spec) == head_script(cluster["spec"])
    assert_service_names_allowed(spec, service)
    assert job["metadata"]["annotations"] == cluster["metadata"]["annotations"]
    assert spec["rayVersion"] == cluster["spec"]["rayVersion"]
    labels = spec["headGroupSpec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert (
        service["spec"]["selector"]
        != by_kind(KUBERAY / "raycluster.yaml")["Service"]["spec"]["selector"]
    )
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["python", "/opt/profd/examples/ray_train_torchtrainer.py"]
    assert (ROOT / "examples" / "ray_train_torchtrainer.py").is_file()
    assert "COPY --chown=1000:100 examples /opt/profd/examples" in DOCKERFILE.read_text()
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ray_train_torchtrainer.py"), *argv[2:], "-h"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr  # the example accepts the entrypoint's flags
    for flag in (a for a in argv[2:] if a.startswith("--")):
        assert flag in out.stdout


# -- image and cluster launcher ---------------------------------------------------------------
def ray_versions() -> dict[str, str]:
    args = dict(a.split("=", 1) for w, a in dockerfile_instructions() if w == "ARG" and "=" in a)
    cluster = by_kind(KUBERAY / "raycluster.yaml")["RayCluster"]["spec"]
    image = yaml.safe_load(LAUNCHER.read_text())["docker"]["image"]
    tag = re.compile(r"rayproject/ray:(\d+\.\d+\.\d+)-")
    return {
        "Dockerfile": tag.match(args["RAY_IMAGE"]).group(1),
        "RayCluster": cluster["rayVersion"],
        "image tag": head_container(cluster)["image"].rsplit(":", 1)[1],
        "cluster launcher": tag.match(image).group(1),
    }


def test_dockerfile_builds_profd_on_a_ray_image_without_choosing_torch() -> None:
    steps = dockerfile_instructions()
    words = [w for w, _ in steps]
    assert (
        words[words.index("FROM") - 1] == "ARG" and steps[words.index("FROM")][1] == "${RAY_IMAGE}"
    )
    assert len(set(ray_versions().values())) == 1, ray_versions()
    ignore = (DEPLOY / "docker" / "Dockerfile.dockerignore").read_text().split()
    for word, rest in steps:
        if word == "COPY":
            *sources, _dest = [t for t in rest.split() if not t.startswith("--")]
            for src in sources:
                assert (ROOT / src).exists(), src
                assert f"!{src}" in ignore or f"!{src}/" in ignore, f"{src} is not in the context"
    (run,) = [rest for word, rest in steps if word == "RUN"]
    assert_torch_rule(run)
    assert "/opt/profd" in run and "profd --help" in run


def assert_torch_rule(shell: str) -> None:
    """pip may install torch only pinned (==), and installs profd only with constraints."""
    installs = [c for c in re.split(r"&&|\|\||;|\n", shell) if "pip install" in c]
    assert installs
    for cmd in installs:
        if re.search(r"\btorch\b", cmd):
            assert re.search(r'"?\$\{TORCH_SPEC\}"?|torch==\d', cmd), cmd
        if "profd" in cmd:
            assert " -c " in cmd, cmd


def test_cluster_launcher_config_is_valid_for_ray_and_starts_profd_on_the_head() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(LAUNCHER.read_text())
    validate_config(prepare_config(copy.deepcopy(config)))  # Ray's own (strict) schema
    bad = copy.deepcopy(config)
    bad["head_start_commands"] = bad.pop("head_start_ray_commands")
    with pytest.raises(Exception, match="head_start_commands"):
        validate_config(bad)
    head = config["head_start_ray_commands"]
    assert head[0] == "ray stop" and "ray start --head" in head[1]
    assert head[-1].endswith("profd up --address auto")  # after Ray is up, on the head only
    assert not any("profd" in c for c in config["worker_start_ray_commands"])
    (target,) = [t for t, src in config["file_mounts"].items() if src == "."]
    assert_torch_rule("\n".join(config["setup_commands"]))
    assert any(target in c and " -c " in c for c in config["setup_commands"])


# -- the KubeRay head script, run for real ------------------------------------------------------
def runnable_head_script(tmp_path: Path, token_file: Path) -> str:
    """The head's script with the pod-only parts swapped for the test's (each must exist, so
    the manifest cannot drift away from what is run here)."""
    script = head_script(by_kind(KUBERAY / "raycluster.yaml")["RayCluster"]["spec"])
    swaps = {
        "/etc/profd/token": str(token_file),
        "/tmp/profd-up.log": str(tmp_path / "profd-up.log"),
        "--host 0.0.0.0": "--host 127.0.0.1",  # tests stay on loopback
        "--port 8470": "--port 0",
        "--save-root /home/ray/profd-traces": f"--save-root {tmp_path / 'traces'}",
        "$(seq 1 60)": "$(seq 1 3)",
        "sleep 5": "sleep 1",
        "$KUBERAY_GEN_RAY_START_CMD": "wait",  # Ray is already up: wait for profd's part
    }
    for old, new in swaps.items():
        assert old in script, old
        script = script.replace(old, new)
    return script


def run_head_script(script: str, tmp_path: Path, address: str, up_args: str = "") -> str:
    env = dict(
        os.environ,
        HOME=str(tmp_path),
        PROFD_STATE_DIR=str(tmp_path / "state"),
        PROFD_UP_ARGS=up_args,  # the manifest's variable, as an operator sets it
        PROFD_SERVICE="profd",  # the manifest's Service
        POD_NAMESPACE="team-a",  # what the downward API gives
        RAY_ADDRESS=address,  # what `--address auto` finds on a real head
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    )
    r = subprocess.run(["/bin/bash", "-c", script], env=env, cwd=tmp_path, timeout=180)
    assert r.returncode == 0
    return (tmp_path / "profd-up.log").read_text()


def test_kuberay_head_script_refuses_the_template_token(tmp_path: Path) -> None:
    token = tmp_path / "secret" / "token"
    token.parent.mkdir()
    token.write_text(TEMPLATE_TOKEN)
    log = run_head_script(runnable_head_script(tmp_path, token), tmp_path, "127.0.0.1:9")
    assert "holds the template value; not starting" in log
    assert not (tmp_path / "state").exists()


def test_kuberay_head_script_starts_profd_for_a_running_job(ray_session: Any, tmp_path: Path):
    """The head's script on a cluster whose job already runs: detached services with the
    Secret's token, the job's agents found, a session over HTTP, a trace downloaded from the
    worker's node; the script run twice is harmless; `profd down` stops the services."""
    import ray

    from profd.cli.ray_cluster import stop_services
    from profd.core.ray_env import find_coordinator, find_sidecar
    from profd.demo.workload import DemoWorker, StepBudget

    stop_services()
    wait_until(lambda: find_coordinator() is None and find_sidecar() is None, 30, what="no profd")
    token = tmp_path / "secret" / "token"
    token.parent.mkdir()
    token.write_text(TOKEN)  # as a Secret volume: no trailing newline
    script = runnable_head_script(tmp_path, token)
    address = ray_session.address_info["address"]
    # the job started before profd: its workers (on the second node) attached, found nothing
    remote = ray.remote(DemoWorker).options(num_cpus=0, resources={"node_b": 0.01})
    workers = [remote.remote("actor", rank, 2, seed=2) for rank in range(2)]
    budget = ray.remote(StepBudget).options(num_cpus=0).remote()
    try:
        ray.get([w.ready.remote() for w in workers], timeout=120)
        ray.get(budget.extend_to.remote(80))
        for w in workers:
            w.run.remote(80, 0.3, 1, budget)
        uploads = tmp_path / "uploads"
        up_args = f"--allow-upload-prefix file://{uploads}"
        log = run_head_script(script, tmp_path, address, up_args)
        assert "profd is up: sidecar http://127.0.0.1:" in log, log
        state = tmp_path / "state"
        assert (state / "token").read_text() == TOKEN
        assert oct((state / "token").stat().st_mode & 0o777) == "0o600"
        url = yaml.safe_load((state / "sidecar.json").read_text())["url"]
        # the `profd up` process has exited: the services outlive it, on the head, detached
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        for handle in (find_coordinator(), find_sidecar()):
            info = ray._private.state.actors(handle._actor_id.hex())
            assert info["IsDetached"] is True, info
            assert info["Address"]["NodeID"] == ray_session.node_id
        # requests naming the Service are answered, other names refused (DNS rebinding)
        for host in ("profd", "profd.team-a.svc.cluster.local:8470", "localhost"):
            r = httpx.get(f"{url}/api/v1/agents", headers={**AUTH, "Host": host}, timeout=10)
            assert r.status_code == 200, (host, r.text)
        r = httpx.get(f"{url}/api/v1/agents", headers={**AUTH, "Host": "attacker.example"})
        assert r.status_code == 400 and r.json()["error"] == "host_not_allowed", r.text
        # the sidecar takes the Secret's token, and only it
        bad = httpx.post(f"{url}/api/v1/sessions", json={}, headers={"Authorization": "Bearer x"})
        assert bad.status_code == 403

        def stepping() -> bool:
            agents = httpx.get(f"{url}/api/v1/agents", headers=AUTH, timeout=10).json()["data"]
            return sum(a["current_step"] is not None for a in agents) == 2

        wait_until(stepping, 60, 0.2, what="the running job's agents")
        body: dict[str, Any] = {"next_steps": 1, "roles": {"actor": {"all_ranks": True}}}
        # PROFD_UP_ARGS reached `profd up`: an upload_uri under the allowed prefix only
        outside = dict(body, upload_uri=f"file://{tmp_path / 'elsewhere'}")
        r = httpx.post(f"{url}/api/v1/sessions", json=outside, headers=AUTH, timeout=30)
        assert r.status_code == 422 and "upload_uri" in r.text, r.text
        body["upload_uri"] = f"file://{uploads}/team"
        r = httpx.post(f"{url}/api/v1/sessions", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 201, r.text
        sid = r.json()["session_id"]

        def ended() -> Any:
            v = httpx.get(f"{url}/api/v1/sessions/{sid}", headers=AUTH, timeout=10).json()
            return v if v["state"] not in ("pending", "armed", "recording", "collecting") else None

        view = wait_until(ended, 60, 0.2, what="session end")
        assert view["state"] == "done" and sorted(t["rank"] for t in view["traces"]) == [0, 1]
        trace = view["traces"][0]
        assert trace["node_id"] != ray_session.node_id  # written on the second node
        got = httpx.get(f"{url}/api/v1/traces/{trace['trace_id']}/download", headers=AUTH)
        assert got.status_code == 200 and got.headers["X-Profd-Node"] == trace["node_id"]
        assert got.content == Path(trace["path"]).read_bytes()
        names = sorted(Path(t["path"]).name for t in view["traces"])
        wait_until(
            lambda: sorted(p.name for p in (uploads / "team" / sid).glob("*.json.gz")) == names,
            30,
            0.2,
            what="the uploads",
        )
    finally:
        for w in workers:
            ray.kill(w)
    try:
        # a restarted head script (or `profd up` twice) is harmless and says so
        again = run_head_script(script, tmp_path, address)
        assert "already up" in again
        # state says `auto`: pin it to this session's Ray, never another one on the machine
        env = dict(os.environ, HOME=str(tmp_path), PROFD_STATE_DIR=str(state), RAY_ADDRESS=address)
        down = subprocess.run(
            [sys.executable, "-m", "profd.cli.main", "down"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert down.returncode == 0 and "profd_sidecar, profd_coordinator" in down.stdout
        wait_until(lambda: find_coordinator() is None and find_sidecar() is None, 30, what="down")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/healthz", timeout=5)
    finally:
        stop_services()
