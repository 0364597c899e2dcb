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
    assert report and json.dumps(report)  # machine-readable, and it parsed


def test_probe_memory_section_writes_json(tmp_path):
    slipstream("probe", "--sections", "memory", "--out", "probe.json", cwd=tmp_path)
    result = json.loads((tmp_path / "probe.json").read_text())
    assert "memory" in json.dumps(result)


def test_doctor_bad_trace_is_a_user_error(tmp_path):
    bad = tmp_path / "not-a-trace.json"
    bad.write_text("{ truncated")
    proc = slipstream("doctor", "--trace", bad, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
