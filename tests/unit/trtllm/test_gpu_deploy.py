"""compose.yaml's `gpu` profile and docker/Dockerfile.trtllm, checked without Docker or GPUs."""

from __future__ import annotations

import re

import pytest
import yaml

from pdmesh.compose_launch import load_compose
from tests.unit.deploy import repo

COMPOSE = repo.ROOT / "compose.yaml"
DOCKERFILE = repo.ROOT / "docker" / "Dockerfile.trtllm"
GPU = {"router-gpu", "prefill-gpu", "decode-gpu"}  # the router serves HTTP itself: no gateway
PINNED = "1.3.0rc13"


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_gpu_services_exist_only_in_the_gpu_profile(raw):
    assert {n for n, s in raw.items() if "gpu" in s.get("profiles", ())} == GPU
    assert not GPU & set(load_compose(COMPOSE))  # `docker compose up` without --profile skips them
    assert set(load_compose(COMPOSE, profiles=("gpu",))) >= GPU


def test_workers_run_trtllm_on_separate_gpus_with_the_model_read_only(raw):
    services = load_compose(COMPOSE, profiles=("gpu",))
    gpus = []
    for name in ("prefill-gpu", "decode-gpu"):
        env = services[name].env
        assert env["PDMESH_ENGINE_BACKEND"] == "trtllm" and env["PDMESH_ENGINE_MODEL_PATH"] == "/models/model"
        (device,) = raw[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        gpus.append(device["device_ids"])
        assert "PDMESH_KVTRANSFER_ADDRESS" not in env  # TensorRT-LLM moves the KV itself
    assert gpus[0] != gpus[1]
    for name in GPU:
        assert any(v.endswith(":/models/model:ro") for v in raw[name]["volumes"]), name
        assert raw[name]["build"]["dockerfile"] == "docker/Dockerfile.trtllm"


def test_gpu_services_use_real_flags_and_peers(raw):
    services = load_compose(COMPOSE, profiles=("gpu",))
    for name in GPU:
        svc = services[name]
        assert repo.module_exists(svc.module)
        unknown = {k for k in svc.env if k.startswith("PDMESH_")} - repo.flag_env_names(svc.module)
        assert not unknown, f"{name}: {sorted(unknown)}"
        for _, (host, port) in [(k, m) for k, v in svc.env.items() for m in repo.ADDRESS.findall(v)]:
            # a service port, or the router's internal (membership) listener
            assert host in GPU and host in svc.depends_on, name
            assert int(port) in (services[host].port, services[host].internal_port), name


def test_dockerfile_pins_the_release_image_the_fake_mirrors():
    text = DOCKERFILE.read_text()
    assert re.search(
        rf"^ARG TRTLLM_IMAGE=nvcr\.io/nvidia/tensorrt-llm/release:{re.escape(PINNED)}$", text, re.M
    )
    import tensorrt_llm  # the fake (tests/unit/trtllm/conftest.py puts it on sys.path)

    assert tensorrt_llm.__version__ == PINNED
    for path in ("pdmesh", "services", "kvtransfer", "scripts/gpu_check.sh"):
        assert f"COPY {path} " in text and (repo.ROOT / path).exists(), path
