"""bench.frameworks_pool: pooling runs of ``python -m bench.frameworks`` (issue 34's benchmark)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.frameworks_pool import main, pooled


def _run(ours: list[float], stock: list[float], size: int = 128 << 20) -> dict[str, Any]:
    systems = [{"name": "titan_dcp_ext", "label": "ours"}, {"name": "titan_stock", "label": "stock"}]
    return {"params": {"size": size}, "main_table": {"file": "m.json", "local": {"2": {"ratio": 1.5}}},
            "kinds": {"local": {"systems": systems, "seconds": {"titan_dcp_ext": ours, "titan_stock": stock}}}}


def test_runs_are_pooled_save_by_save(tmp_path: Path, capsys: Any) -> None:
    a, b = _run([1.0, 1.0, 4.0], [2.0, 2.0, 2.0]), _run([1.0, 1.0], [3.0, 3.0])
    (row,) = pooled([a, b])
    # Medians over all 5 saves of each system (1.0 and 2.0), not the mean of the runs' ratios.
    assert (row["n"], row["ours_s"], row["default_s"], row["ratio"]) == (5, 1.0, 2.0, 2.0)
    assert row["per_run"] == [2.0, 3.0] and row["paired"] == 2.0  # same-round ratios 2, 2, 0.5, 3, 3
    for i, record in enumerate((a, b)):
        (tmp_path / f"{i}.json").write_text(json.dumps(record))
    assert main([str(tmp_path / "0.json"), str(tmp_path / "1.json")]) == 0
    table = capsys.readouterr().out
    assert "| local | ours / stock | 5 | 1.00 / 2.00 | 2.00× [2.00] | 2.00, 3.00 | 1.50× | ✅ |" in table
    # Runs of another size are refused, naming the files.
    (tmp_path / "big.json").write_text(json.dumps(_run([1.0], [2.0], size=1 << 30)))
    assert main([str(tmp_path / "0.json"), str(tmp_path / "big.json")]) == 2
    assert "big.json" in capsys.readouterr().err


def test_a_local_only_default_is_the_ceiling_of_the_s3_row() -> None:
    """torch_checkpointing's own storage runs locally only: tc_dcp_ext on S3 is held against it (issue 43)."""
    from bench.frameworks_report import summarize

    systems = {"local": [{"name": "tc_dcp_ext"}, {"name": "tc_stock"}], "s3": [{"name": "tc_dcp_ext"}]}
    seconds = {"local": {"tc_dcp_ext": [1.0], "tc_stock": [2.0]}, "s3": {"tc_dcp_ext": [4.0]}}
    record = {"kinds": {k: {"systems": [{**m, "framework": "torch_checkpointing", "bytes": 1} for m in systems[k]],
                            "seconds": seconds[k], "stored": {}, "files": {}} for k in systems}}
    (local, s3) = pooled([record])
    assert (local["default_kind"], local["ratio"]) == ("local", 2.0)
    assert (s3["kind"], s3["default_kind"], s3["default_s"], s3["ratio"]) == ("s3", "local", 2.0, 0.5)
    ratios = summarize(record)["ratios"]
    assert ratios["s3"]["tc_dcp_ext"] == {"default": "tc_stock", "default_kind": "local", "ratio": 0.5, "paired": 0.5}
