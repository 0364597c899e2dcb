"""`slipstream bench data --size ci`: every reader runs (the S3 one against a moto server the
bench starts), and the JSON holds what the README quotes."""

import json
import subprocess
import sys


def test_bench_data_ci_measures_every_reader(tmp_path):
    out = tmp_path / "data.json"
    proc = subprocess.run([sys.executable, "-m", "slipstream", "bench", "data", "--size", "ci", "--out", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    readers = {r["reader"]: r for r in result["readers"]}
    assert set(readers) == {"local shards, in process", "local shards, 2 workers", "streaming, local folder",
                            "streaming, HTTP server", "streaming, S3 (moto)"}
    for row in readers.values():
        assert "skipped" not in row, row
        assert row["tokens_per_s"] > 0 and 0 <= row["wait_share_gpt2"] < 1 and 0 <= row["wait_share_gpt2_no_handoff_thread"] < 1
    assert [p["input"] for p in result["prepare"]] == ["parquet", "jsonl"]
    assert result["prepare"][0]["tokens"] == result["prepare"][1]["tokens"]  # the same documents either way
    assert len(result["default_job"]) == 3 and all(r["step_time_s"] > 0 for r in result["default_job"])
    assert 0.001 < result["gpt2_shape"]["planned_step_s_h100_bf16"] < 1
    assert result["env"]["cpu_model"]
