"""afd_* metrics: what the counting sites publish, the multiprocess path to the API server's
/metrics (vLLM's own prometheus_client multiprocess mode), and the README table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from afd_core.metadata import AFDPayload, AFDTransferMetadata
from afd_runtime import metrics
from prometheus_client import REGISTRY, CollectorRegistry, multiprocess
from prometheus_client.exposition import generate_latest

README = Path(__file__).resolve().parents[1] / "README.md"


_REGISTRY = CollectorRegistry()
_METRICS = metrics.AFDMetrics(_REGISTRY)  # this module's own: values start at 0


def _value(name: str, **labels: str) -> float:
    value = _REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_the_default_metrics_are_registered_once_in_the_default_registry() -> None:
    names = {m._name for m in metrics.METRICS.all()}
    assert len(names) == len(metrics.METRICS.all()) and all(n.startswith("afd_") for n in names)
    metrics.RoleMetrics("ffn", 40).steps.inc()
    assert REGISTRY.get_sample_value("afd_steps_total", {"role": "ffn", "rank": "40"}) == 1


def test_role_metrics_count_calls_per_layer_and_tokens_per_call() -> None:
    m = metrics.RoleMetrics("ffn", 41, _METRICS)
    m.compute_call(3, 5)
    m.compute_call(3, 7)
    m.compute_call(5, 1)
    assert _value("afd_ffn_compute_calls_total", role="ffn", rank="41", layer="3") == 2
    assert _value("afd_ffn_compute_calls_total", role="ffn", rank="41", layer="5") == 1
    assert _value("afd_ffn_tokens_per_call_sum", role="ffn", rank="41") == 13
    assert _value("afd_ffn_tokens_per_call_count", role="ffn", rank="41") == 3
    # 5 and 7 tokens land above the 4-token bucket, 1 token at or below it.
    assert _value("afd_ffn_tokens_per_call_bucket", role="ffn", rank="41", le="4.0") == 1
    m.connected()
    m.link_up.set(0)
    m.connected()
    assert _value("afd_connections_total", role="ffn", rank="41") == 2
    assert _value("afd_link_up", role="ffn", rank="41") == 1
    ts = _value("afd_startup_phase_timestamp_seconds", role="ffn", rank="41", phase="connected")
    assert ts > 1.6e9


class _Conn:
    """An Attention-side connector stand-in: replies after the send, one row per token."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def send_dispatch(self, payloads: Any, metadata: AFDTransferMetadata) -> Any:
        self.sent.append(metadata.layer_idx)
        return _Handle(metadata)

    def recv_combine(self, handle: Any) -> list[torch.Tensor]:
        return [torch.zeros(n, 4) for n in handle.metadata.num_tokens]


class _Handle:
    def __init__(self, metadata: AFDTransferMetadata) -> None:
        self.metadata = metadata


def test_attention_connector_instrumentation_times_each_layer_and_counts_bytes() -> None:
    m = metrics.RoleMetrics("attention", 42, _METRICS)
    conn = _Conn()
    metrics.instrument_attention_connector(conn, m)
    metrics.instrument_attention_connector(conn, m)  # idempotent: one wrapper
    payload = AFDPayload(hidden_states=torch.zeros(3, 4))
    for layer in (1, 2, 2):
        meta = AFDTransferMetadata(layer, 0, (3,))
        conn.recv_combine(conn.send_dispatch([payload], meta))
    assert conn.sent == [1, 2, 2]
    labels = {"role": "attention", "rank": "42"}
    assert _value("afd_attention_ffn_wait_seconds_count", **labels, layer="1") == 1
    assert _value("afd_attention_ffn_wait_seconds_count", **labels, layer="2") == 2
    assert _value("afd_sent_bytes_total", **labels) == 3 * 3 * 4 * 4
    assert _value("afd_received_bytes_total", **labels) == 3 * 3 * 4 * 4
    # Expert parallel: the combined replies of both FFN ranks count.
    meta = AFDTransferMetadata(7, 0, (2, 0))
    conn.recv_combine(conn.send_dispatch([payload, payload], meta))
    assert _value("afd_attention_ffn_wait_seconds_count", **labels, layer="7") == 1
    assert _value("afd_received_bytes_total", **labels) == 3 * 3 * 4 * 4 + 2 * 4 * 4


_CHILD = textwrap.dedent(
    """
    import sys
    from afd_runtime.metrics import RoleMetrics, multiprocess_enabled
    assert multiprocess_enabled(), "prometheus_client did not pick its multiprocess values"
    rank = int(sys.argv[1])
    m = RoleMetrics("attention", rank)
    m.steps.inc(3 + rank)
    m.connected()
    m.param_bytes(1000 + rank)
    """
)


def _run_child(env: dict[str, str], rank: int) -> None:
    subprocess.run([sys.executable, "-c", _CHILD, str(rank)], env=env, check=True, timeout=120)


def test_engine_processes_reach_the_api_servers_collector(tmp_path: Path) -> None:
    """Two engine-core-like processes (two data-parallel ranks) write to the multiprocess
    directory; the collector vLLM's /metrics uses reads both."""
    env = {**os.environ, metrics.MULTIPROC_ENV: str(tmp_path)}
    for rank in (0, 1):
        _run_child(env, rank)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    text = generate_latest(registry).decode()
    for rank in (0, 1):
        assert f'afd_steps_total{{rank="{rank}",role="attention"}} {3.0 + rank}' in text, text
        assert f'afd_param_bytes{{rank="{rank}",role="attention"}} {1000.0 + rank}' in text
        assert f'afd_link_up{{rank="{rank}",role="attention"}} 1.0' in text


_ADOPT = textwrap.dedent(
    """
    import os, sys
    from prometheus_client import values  # chosen before the directory exists (a forked core)
    assert values.ValueClass is values.MutexValue
    from afd_runtime.metrics import MULTIPROC_ENV, RoleMetrics, adopt_multiprocess_values
    assert not adopt_multiprocess_values()  # no directory: stays in memory
    os.environ[MULTIPROC_ENV] = sys.argv[1]
    assert adopt_multiprocess_values()
    RoleMetrics("ffn", 3).steps.inc(7)
    """
)


def test_a_core_that_imported_prometheus_client_first_adopts_the_directory(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if k != metrics.MULTIPROC_ENV}
    subprocess.run([sys.executable, "-c", _ADOPT, str(tmp_path)], env=env, check=True, timeout=120)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    assert registry.get_sample_value("afd_steps_total", {"role": "ffn", "rank": "3"}) == 7


_ENABLE = textwrap.dedent(
    """
    import os, sys
    import prometheus_client  # imported first, as in vllm serve
    from prometheus_client import values
    assert values.ValueClass is values.MutexValue
    from afd_runtime.metrics import MULTIPROC_ENV, enable_multiprocess_metrics, multiprocess_enabled
    path = enable_multiprocess_metrics()
    assert os.environ[MULTIPROC_ENV] == path and os.path.isdir(path) and not os.listdir(path)
    assert enable_multiprocess_metrics() == path  # idempotent
    assert multiprocess_enabled()
    print(path)
    """
)


def test_enable_multiprocess_metrics_uses_vllms_fresh_directory() -> None:
    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if k != metrics.MULTIPROC_ENV}
    out = subprocess.run(
        [sys.executable, "-c", _ENABLE], env=env, check=True, timeout=300, capture_output=True
    )
    path = out.stdout.decode().strip().splitlines()[-1]
    # vLLM's TemporaryDirectory: removed when the process exits (no stale files for a next run).
    assert path and not Path(path).exists()


def test_readme_metrics_table_matches_the_metrics() -> None:
    text = README.read_text()
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(afd_[a-z0-9_]+)` \| (\w+) \| ([^|]+) \|", section, flags=re.M)
    documented = {name: (kind, labels.strip()) for name, kind, labels in rows}
    shipped = {}
    for metric in metrics.METRICS.all():
        labels = ", ".join(f"`{label}`" for label in metric._labelnames)
        shipped[metric._name] = (metric._type, labels)
    assert documented == shipped
