"""Settings: flags over COALESCE_* environment over defaults, validated once."""

from __future__ import annotations

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
    """A 16-CPU host where torch could use a CUDA device (detection mocked: no test may depend on what
    this machine has; ``kernels/onnx_runner``'s tests hold the detection itself); each test takes away
    what it needs to."""
    from coalesce.kernels import onnx_runner

    monkeypatch.setattr(onnx_runner, "cuda_visible", lambda: True)
    monkeypatch.setattr(onnx_runner, "cpu_allowance", lambda: 16)
    return monkeypatch


def test_workers_auto_starts_gateways_only_where_a_gpu_runs_the_models(gpu_host: pytest.MonkeyPatch) -> None:
    from coalesce.kernels import onnx_runner
    from coalesce.service.settings import auto_workers

    def decide(*flags: str) -> tuple[int, str]:
        return auto_workers(build(["--workers", "auto", *flags], environ={}))

    assert decide() == (4, "a CUDA device and 16 cores")
    assert decide("--device", "cuda:1")[0] == 4
    assert decide("--device", "cpu") == (1, "--device cpu")
    assert decide("--backend", "onnx", "--device", "auto")[0] == 1
    gpu_host.setattr(onnx_runner, "cpu_allowance", lambda: 6)
    assert decide()[0] == 3  # at most half the CPUs (a container's quota counts: cpu_allowance)
    gpu_host.setattr(onnx_runner, "cpu_allowance", lambda: 3)
    assert decide() == (1, "a CUDA device, but 3 cores")
    gpu_host.setattr(onnx_runner, "cpu_allowance", lambda: 16)
    gpu_host.setattr(onnx_runner, "cuda_visible", lambda: False)
    assert decide() == (1, "no CUDA device torch could use")
    assert decide("--device", "cuda")[0] == 4  # asked for plainly: no guessing
