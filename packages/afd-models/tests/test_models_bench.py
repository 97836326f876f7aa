"""``afd bench``'s arithmetic, table and argument checks (the measurement itself is a benchmark)."""

from __future__ import annotations

import pytest

pytest.importorskip("requests")

from afd_models import cli
from afd_models.demo.bench import BenchConfig, TPOTRow, compare, render


def test_compare_derives_ratio_and_overhead_per_layer() -> None:
    plain = [TPOTRow("plain", 1, 10.0, (10.0,)), TPOTRow("plain", 16, 20.0, (20.0,))]
    afd = [TPOTRow("afd 1:1", 1, 12.0, (12.0,)), TPOTRow("afd 2:1", 16, 40.0, (40.0,))]
    rows = compare(plain, afd, {1: 0.25, 16: 0.5}, layers=4)
    assert [(r.setup, r.batch) for r in rows] == [("afd 1:1", 1), ("afd 2:1", 16)]
    first, second = rows
    assert (first.ratio, first.overhead_per_layer_ms, first.overhead_in_round_trips) == (
        1.2,
        0.5,
        2.0,
    )
    assert first.meets_targets
    assert (second.ratio, second.overhead_per_layer_ms, second.overhead_in_round_trips) == (
        2.0,
        5.0,
        10.0,
    )
    assert not second.meets_targets
    table = render(rows).splitlines()
    assert table[2] == "| afd 1:1 | 1 | 10.00 | 12.00 | 1.20 | 0.500 | 0.250 | 2.0 | met |"
    assert table[3].endswith("| 2.00 | 5.000 | 0.500 | 10.0 | MISSED |")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"batch_sizes": ()}, "batch_sizes"),
        ({"batch_sizes": (1, 0)}, "batch_sizes"),
        ({"max_tokens": 3}, "max_tokens"),
        ({"repeats": 0}, "repeats"),
    ],
)
def test_bench_config_rejects_bad_values(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        BenchConfig(**kwargs)  # type: ignore[arg-type]


def test_bench_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        cli.main(["bench", "--batch-sizes", "1,x"])
    assert err.value.code == cli.EXIT_USAGE
    assert "afd bench" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        cli.main(["bench", "--repeats", "0"])
    assert err.value.code == cli.EXIT_USAGE
    assert "repeats=0" in capsys.readouterr().err
