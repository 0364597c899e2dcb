"""`slipstream bench ladder compression`: every row took effect, the committed results are whole
and the README's table is the committed JSON's."""

import json
import math
import re
from pathlib import Path

import pytest

from slipstream.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
ROWS = ["dense fp32", "magnitude 50%", "magnitude 90%", "2:4", "QAT int8-dynact-int4-weight", "QAT int8-weight",
        "optimizer state int8", "optimizer state int4", "export int8", "export int4", "one-shot magnitude 50%",
        "one-shot Wanda 50%"]
COMMITTED = {size: ROOT / "benchmarks" / f"ladder-compression-cpu-{size}.json" for size in ("tiny", "gpt2")}


@pytest.fixture(scope="module")
def ci_result(tmp_path_factory, data_dir):
    pytest.importorskip("torchao")
    from slipstream.perf.compression_ladder import run_compression_ladder

    out = tmp_path_factory.mktemp("compression")
    # device="cpu" explicitly: the path `--device cuda` takes, on the CPU (every load, eval, prune and
    # generate gets the device from here)
    result = run_compression_ladder(size="ci", out_dir=str(out), data_dir=str(data_dir), device="cpu")
    return result, out / "ladder-compression-cpu-ci.json"


def _rows(result):
    return {r["rung"]: r for r in result["rungs"]}


def test_every_row_is_measured_and_written(ci_result):
    result, path = ci_result
    assert [r["rung"] for r in result["rungs"]] == ROWS
    assert json.loads(path.read_text())["rungs"][0]["val_loss"] == result["rungs"][0]["val_loss"]
    assert result["bench"] == "ladder-compression" and result["tokens_per_row"] == result["steps"] * 4 * 64
    assert result["env"]["cpu_model"] and "torch_version" in result["env"] and "git_sha" in result["env"]
    for r in result["rungs"]:
        assert math.isfinite(r["val_loss"]) and r["checkpoint_bytes"] > 0
        if r["kind"] == "train":
            assert r["tokens"] == result["tokens_per_row"] and r["peak_bytes"] > 0 and r["step_time_s"] > 0
        else:  # not trained: no training columns
            assert r.get("peak_bytes") is None and r.get("step_time_s") is None


def test_sparsity_rows_reach_their_target_in_the_weights(ci_result):
    rows = _rows(ci_result[0])
    dense = rows["dense fp32"]
    assert "sparsity" not in dense
    for name, target in (("magnitude 50%", 0.5), ("magnitude 90%", 0.9), ("2:4", 0.5), ("one-shot magnitude 50%", 0.5),
                         ("one-shot Wanda 50%", 0.5)):
        assert rows[name]["sparsity"] == pytest.approx(target, abs=2e-3), name
        assert rows[name]["layer_sparsity_min"] == pytest.approx(target, abs=2e-3), name
    assert rows["2:4"]["blocks_two_of_four"] == 1.0  # every block of four input weights: exactly two zeros
    # pruning without fine-tuning costs loss; 90 % costs more than 50 %
    assert rows["one-shot magnitude 50%"]["val_loss"] > dense["val_loss"]
    assert rows["one-shot Wanda 50%"]["val_loss"] > dense["val_loss"]
    assert rows["magnitude 90%"]["val_loss"] > rows["magnitude 50%"]["val_loss"]
    assert rows["one-shot Wanda 50%"]["calibration_tokens"] > 0


def test_qat_rows_train_quantized_and_convert_to_what_they_trained(ci_result):
    rows = _rows(ci_result[0])
    dense = rows["dense fp32"]
    for name in ("QAT int8-dynact-int4-weight", "QAT int8-weight"):
        r = rows[name]
        assert r["val_loss"] != dense["val_loss"]  # the fake quantizers were on
        # the converted model's loss is the fake-quantized one (torchao: bit for bit)
        assert r["quantized_val_loss"] == pytest.approx(r["val_loss"], abs=1e-5)
        assert r["quantized_bytes"] < 0.6 * dense["checkpoint_bytes"]
        assert r["peak_bytes"] > dense["peak_bytes"]  # fake quantization's extra tensors


def test_low_bit_states_are_a_quarter_and_an_eighth(ci_result):
    rows = _rows(ci_result[0])
    fp32 = rows["dense fp32"]["optimizer_state_bytes"]
    int8, int4 = rows["optimizer state int8"]["optimizer_state_bytes"], rows["optimizer state int4"]["optimizer_state_bytes"]
    # 1/4 and 1/8 of fp32 for the quantized tensors, plus their block scales; the ci model's small tensors
    # (under 4096 values: norms, biases) keep fp32 moments, so the whole is a little above
    assert 0.25 < int8 / fp32 < 0.35
    assert 0.125 < int4 / fp32 < 0.2
    assert rows["optimizer state int8"]["peak_bytes"] < rows["dense fp32"]["peak_bytes"]
    assert rows["optimizer state int4"]["peak_bytes"] < rows["optimizer state int8"]["peak_bytes"]
    assert rows["optimizer state int8"]["vs_dense"]["optimizer_state_bytes"] == pytest.approx(int8 / fp32)


def test_export_rows_are_smaller_and_rounded(ci_result):
    rows = _rows(ci_result[0])
    dense = rows["dense fp32"]
    for name in ("export int8", "export int4"):
        r = rows[name]
        assert r["checkpoint_bytes"] < 0.6 * dense["checkpoint_bytes"]
        assert r["val_loss"] != dense["val_loss"] and abs(r["val_loss"] - dense["val_loss"]) < 0.05
        assert r["generate_tokens_per_s"] > 0
    assert dense["generate_tokens_per_s"] > 0
    # a plain export of a trained row is the dense file's size: masks and low-bit states are not in model.pt
    assert rows["magnitude 50%"]["checkpoint_bytes"] == dense["checkpoint_bytes"]


def test_report_renders_the_compression_ladder(ci_result):
    from slipstream.report.build import classify
    from slipstream.report.ladder import ladder_sections

    _, path = ci_result
    assert classify(path) == "ladder"
    html = "".join(ladder_sections(path)[0].parts)
    assert 'data-table="ladder-compression-rows"' in html
    assert all(name in html for name in ROWS)


def test_cli_refuses_to_overwrite_without_force(tmp_path, capsys):
    from slipstream.cli import main

    (tmp_path / "ladder-compression-cpu-ci.json").write_text("{}")
    code = main(["bench", "ladder", "compression", "--size", "ci", "--out-dir", str(tmp_path)])
    assert code != 0
    assert "already exists; pass --force" in capsys.readouterr().err
    assert (tmp_path / "ladder-compression-cpu-ci.json").read_text() == "{}"


def test_cli_refuses_sizes_of_the_other_ladders(capsys):
    from slipstream.cli import main

    assert main(["bench", "ladder", "compression", "--size", "book"]) != 0
    assert "not a size of the compression ladder" in capsys.readouterr().err


@pytest.mark.parametrize("size", sorted(COMMITTED))
def test_committed_result_has_every_row_and_the_readme_shows_it(size):
    from slipstream.perf.compression_ladder import markdown_table

    result = json.loads(COMMITTED[size].read_text())
    assert [r["rung"] for r in result["rungs"]] == ROWS
    assert result["size"] == size and result["steps"] > 0 and result["env"]["cpu_model"]
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Compression ladder (measured)", 1)[1].split("\n## ", 1)[0]
    assert markdown_table(result) in section, f"README table of {size} differs from {COMMITTED[size].name}"
    assert re.search(re.escape(COMMITTED[size].name), section)


# --- the device: CPU plumbing, the CUDA refusal, the CUDA-only timings --------------------------

def test_device_reaches_the_run_and_the_file_name(ci_result):
    result, path = ci_result
    assert path.is_file() and result["device"] == "cpu" and "--train.device=cpu" in result["base"]
    rows = _rows(result)
    for r in result["rungs"]:
        assert not r.get("generate_sparse_kernel")  # the sparse kernel is timed on CUDA only
        if r["kind"] == "train":
            assert r["cuda_allocated_before_bytes"] is None  # an allocator reading exists on CUDA only
    assert "generate_tokens_per_s" not in rows["2:4"]
    assert "the sparse kernel needs CUDA" in rows["2:4"]["note"]


def test_output_is_named_by_device_and_size():
    from slipstream.perf.compression_ladder import compression_output

    assert compression_output("gpu", "out", "cuda") == Path("out/ladder-compression-cuda-gpu.json")
    assert compression_output("ci", "out") == Path("out/ladder-compression-cpu-ci.json")


def test_cuda_without_a_gpu_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    import torch

    from slipstream.cli import main
    from slipstream.perf import compression_ladder

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=r"--device cuda needs a CUDA GPU.*--device cpu"):
        compression_ladder.run_compression_ladder(size="ci", out_dir=str(tmp_path), device="cuda")
    assert main(["bench", "ladder", "compression", "--size", "ci", "--device", "cuda", "--out-dir", str(tmp_path)]) != 0
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["bench", "ladder", "compression", "--size", "ci", "--device", "mps", "--out-dir", str(tmp_path)]) != 0
    assert "choose cpu or cuda" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing prepared or written


def test_cuda_times_the_two_four_row_through_the_sparse_kernel(monkeypatch, tmp_path):
    """The generate timings on CUDA (run on CPU with the timing replaced): the 2:4 checkpoint goes through
    --sparse-kernel on the ladder's device, the export rows quantize the dense checkpoint."""
    from slipstream.perf import compression_ladder as cl

    calls = []
    monkeypatch.setattr(cl, "_generate_tokens_per_s",
                        lambda ckpt, tokens, quantize, device, sparse_kernel=False:
                        calls.append((ckpt.name, quantize, device, sparse_kernel)) or 10.0 + len(calls))
    results = [{"rung": row.name, "kind": row.kind, "quantize": row.quantize or None}
               for row in cl.rows_for(cl.SHAPES["gpu"], 6, "cuda")]
    dense, sparse = tmp_path / "dense", tmp_path / "two-four"
    cl._time_generation(cl.generation_variants(results, dense, sparse), 16, "cuda")
    one_round = [("dense", None, "cuda", False), ("dense", "int8", "cuda", False), ("dense", "int4", "cuda", False),
                 ("two-four", None, "cuda", True)]
    assert calls == one_round * cl.GENERATE_ROUNDS  # interleaved rounds
    rows = _rows({"rungs": results})
    assert rows["2:4"]["generate_sparse_kernel"] is True
    assert rows["2:4"]["generate_tokens_per_s"] == 10.0 + 2 * len(one_round)  # the best (here: last) round
    assert "generate_tokens_per_s" not in rows["magnitude 50%"]
    # CPU: no sparse checkpoint, no sparse-kernel timing
    assert [v[3] for v in cl.generation_variants(results, dense, None)] == [False, False, False]


def test_gpu_shape_fits_the_sparse_kernel_and_the_suite_runs_it():
    import torch

    from slipstream.config.load import load_config
    from slipstream.models.transformer import Transformer
    from slipstream.perf.compression_ladder import SHAPES, compression_output
    from slipstream.perf.gpu_items import ITEMS

    shape = SHAPES["gpu"]
    cfg = load_config(None, [*shape.model, "--model.vocab_size=50257"])
    assert (cfg.model.n_layer, cfg.model.d_model) == (12, 768)  # GPT-2 124M
    with torch.device("meta"):
        model = Transformer(cfg.model)
    linears = [m for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)]
    assert linears
    # bf16 2:4 weights: rows a multiple of 32, columns of 64 (torch's CUTLASS semi-structured constraints)
    assert all(m.out_features % 32 == 0 and m.in_features % 64 == 0 for m in linears)
    item = next(i for i in ITEMS if i.name == "ladder-compression")
    assert item.args[:3] == ("bench", "ladder", "compression")
    assert ("--size", "gpu") == item.args[3:5] and ("--device", "cuda") == item.args[5:7]
    assert item.outputs == (str(compression_output("gpu", "{out}", "cuda")),)
