"""The measure-and-explain commands through the real CLI: profile -> doctor on its trace,
probe, and bad input (exit 2, one line)."""

import json

from tests.e2e.test_cli import ROOT, slipstream


def test_profile_then_doctor_on_its_trace(tmp_path, data_dir):
    out = slipstream("profile", "--config", ROOT / "configs" / "tiny.toml", f"--data.dir={data_dir}",
                     "--run.dir=prof", "--steps", "2", cwd=tmp_path).stdout
    trace = tmp_path / "prof" / "traces" / "rank0.json"
    assert trace.is_file() and "aten::" in out
    report = json.loads(slipstream("doctor", "--trace", trace, "--json", cwd=tmp_path).stdout)
    analysis = report["traces"][0]
    assert analysis["has_labels"] and analysis["step_us"] > 0 and analysis["rank"] == 0
    # the split covers the step: compute + exposed comm + exposed copies + idle == step time
    total = analysis["compute_us"] + analysis["comm_exposed_us"] + analysis["memcpy_us"] + analysis["idle_us"]
    assert abs(total - analysis["step_us"]) <= 0.01 * analysis["step_us"]
    assert isinstance(report["findings"], list)


def test_probe_memory_section_writes_json(tmp_path):
    slipstream("probe", "--sections", "memory", "--out", "probe.json", cwd=tmp_path)
    memory = json.loads((tmp_path / "probe.json").read_text())["sections"]["memory"]
    assert memory["copy"]["gbs"] > 0 and memory["h2d_pinned"] == "n/a (no accelerator)"


def test_doctor_bad_trace_is_a_user_error(tmp_path):
    bad = tmp_path / "not-a-trace.json"
    bad.write_text("{ truncated")
    proc = slipstream("doctor", "--trace", bad, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
