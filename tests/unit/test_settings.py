"""Settings: flags over COALESCE_* environment over defaults, validated once."""

from __future__ import annotations

from pathlib import Path

import pytest
from coalesce.service.settings import ModelSpec, build, parse_model_spec


def test_defaults_serve_the_embedded_model_on_8080() -> None:
    s = build([], environ={})
    assert s.port == 8080
    assert s.host == "0.0.0.0"
    assert s.model_specs == (ModelSpec(None, None),)
    assert s.truncate is True


def test_port_variable_is_honoured_and_flags_win() -> None:
    assert build([], environ={"PORT": "9000"}).port == 9000
    assert build([], environ={"PORT": "9000", "COALESCE_PORT": "9100"}).port == 9100
    assert build(["--port", "9200"], environ={"COALESCE_PORT": "9100"}).port == 9200


def test_environment_sets_every_kind_of_knob() -> None:
    s = build(
        [],
        environ={
            "COALESCE_MAX_BATCH_SIZE": "8",
            "COALESCE_TRUNCATE": "false",
            "COALESCE_DRAIN_TIMEOUT_S": "2.5",
            "COALESCE_MODEL": "a=/models/a;b=/models/b",
        },
    )
    assert s.max_batch_size == 8
    assert s.truncate is False
    assert s.drain_timeout_s == 2.5
    assert s.model_specs == (ModelSpec("a", "/models/a"), ModelSpec("b", "/models/b"))


def test_served_model_name_applies_to_the_single_model() -> None:
    s = build(["--model", "/m/x", "--served-model-name", "my-embedder"], environ={})
    assert s.model_specs == (ModelSpec("my-embedder", "/m/x"),)
    assert build(["--no-truncate"], environ={}).truncate is False


def test_model_spec_forms() -> None:
    assert parse_model_spec("/p") == ModelSpec(None, "/p")
    assert parse_model_spec("name=/p") == ModelSpec("name", "/p")
    assert parse_model_spec("name=default") == ModelSpec("name", None)


@pytest.mark.parametrize("argv", [["--max-batch-size", "0"], ["--port", "70000"], ["--log-format", "xml"]])
def test_invalid_values_stop_start_up_with_a_message(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build(argv, environ={})
    assert "invalid settings" in str(info.value)


def test_invalid_environment_value_names_the_variable() -> None:
    with pytest.raises(SystemExit) as info:
        build([], environ={"COALESCE_MAX_BATCH_SIZE": "lots"})
    assert "COALESCE_MAX_BATCH_SIZE" in str(info.value)


def test_settings_are_frozen() -> None:
    s = build([], environ={})
    with pytest.raises(AttributeError):
        s.port = 1  # type: ignore[misc]


def test_a_worker_runs_the_supervisors_flags_as_one_process_on_a_shared_port() -> None:
    from coalesce.service.gateway.workers import child_command

    argv = ["--workers", "4", "--port", "9000", "--max-batch-size", "32"]
    assert build(argv).workers == 4
    # after `python -m coalesce.service.cli serve`:
    gateway = build(child_command(argv, "gateway", "/run/x", 4, 2)[4:])
    assert (gateway.role, gateway.worker_id, gateway.engine_dir) == ("gateway", 2, "/run/x")
    assert (gateway.workers, gateway.reuse_port, gateway.port, gateway.max_batch_size) == (4, True, 9000, 32)
    engine = build(child_command(argv, "engine", "/run/x", 4)[4:])
    assert (engine.role, engine.reuse_port, engine.max_batch_size) == ("engine", False, 32)
    assert build(environ={"COALESCE_WORKERS": "3"}).workers == 3
    with pytest.raises(SystemExit, match="workers"):
        build(["--workers", "0"])


def test_workers_auto_is_decided_at_start_and_its_children_get_the_count() -> None:
    from coalesce.service.gateway.workers import child_command
    from coalesce.service.settings import WORKERS_AUTO

    assert build(["--workers", "auto"]).workers == WORKERS_AUTO
    assert build(environ={"COALESCE_WORKERS": "AUTO"}).workers == WORKERS_AUTO
    # The supervisor's children get the count it decided, after the operator's flags (the last wins).
    gateway = build(child_command(["--workers", "auto"], "gateway", "/run/x", 4, 1)[4:])
    assert gateway.workers == 4
    with pytest.raises(SystemExit, match="workers"):
        build(["--workers", "-2"])


@pytest.fixture
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A 16-core host with an NVIDIA GPU and a CUDA build of torch (detection mocked: no test may depend
    on what this machine has); each test takes away what it needs to."""
    from coalesce.service import settings as settings_mod

    monkeypatch.setattr(settings_mod, "_nvidia_driver", lambda: True)
    monkeypatch.setattr(settings_mod, "_torch_cuda_build", lambda: True)
    monkeypatch.setattr(settings_mod, "_cores", lambda: 16)
    return monkeypatch


def test_workers_auto_starts_gateways_only_where_a_gpu_runs_the_models(gpu_host: pytest.MonkeyPatch) -> None:
    from coalesce.service import settings as settings_mod
    from coalesce.service.settings import auto_workers

    def decide(*flags: str, **env: str) -> tuple[int, str]:
        return auto_workers(build(["--workers", "auto", *flags], environ={}), env)

    assert decide() == (4, "a CUDA device and 16 cores")
    assert decide("--device", "cuda:1")[0] == 4
    assert decide("--device", "cpu") == (1, "--device cpu")
    assert decide("--backend", "onnx", "--device", "auto")[0] == 1
    assert decide(CUDA_VISIBLE_DEVICES="") == (1, "CUDA_VISIBLE_DEVICES hides every GPU")
    assert decide(CUDA_VISIBLE_DEVICES="-1")[0] == 1
    assert decide(CUDA_VISIBLE_DEVICES="0")[0] == 4
    gpu_host.setattr(settings_mod, "_cores", lambda: 6)
    assert decide()[0] == 3  # at most half the cores
    gpu_host.setattr(settings_mod, "_cores", lambda: 3)
    assert decide() == (1, "a CUDA device, but 3 cores")
    gpu_host.setattr(settings_mod, "_cores", lambda: 16)
    gpu_host.setattr(settings_mod, "_torch_cuda_build", lambda: False)
    assert decide() == (1, "torch is not a CUDA build")
    assert decide("--device", "cuda")[0] == 4  # asked for plainly: no guessing
    gpu_host.setattr(settings_mod, "_nvidia_driver", lambda: False)
    assert decide() == (1, "no NVIDIA GPU visible")


def test_a_cuda_build_of_torch_is_read_from_its_version_file() -> None:
    from coalesce.service.settings import names_cuda

    cpu = "__version__ = '2.13.0+cpu'\ndebug = False\ncuda: Optional[str] = None\nhip: Optional[str] = None\n"
    gpu = "__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n"
    old = "__version__ = '1.13.1'\ncuda = '11.7'\n"
    assert (names_cuda(cpu), names_cuda(gpu), names_cuda(old), names_cuda("")) == (False, True, True, False)


def test_the_cores_auto_counts_are_capped_by_the_containers_cpu_quota(tmp_path: Path) -> None:
    """A container's CPU limit is a cgroup quota: a pod limited to 2.5 CPUs counts 3 cores, however many
    the node has; no quota (v2 ``max``, v1 ``-1``) or no cgroup files leaves the affinity's count."""
    import os

    from coalesce.service.settings import _cores

    affinity = len(os.sched_getaffinity(0))
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("250000 100000\n")
    assert _cores(str(v2)) == min(affinity, 3)
    (v2 / "cpu.max").write_text("max 100000\n")
    assert _cores(str(v2)) == affinity
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert _cores(str(tmp_path / "v1")) == 1
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert _cores(str(tmp_path / "v1")) == affinity
    assert _cores(str(tmp_path / "none")) == affinity
