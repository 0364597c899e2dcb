"""One layout in one argument (issue 19): Strategy.label() and parse_layout are exact inverses, the
defaults of what a layout leaves out, the errors of a bad one, and `slipstream plan --layout`."""

from __future__ import annotations

import json

import pytest

from slipstream.cli import main
from slipstream.config import load_config
from slipstream.errors import UserError
from slipstream.plan.hardware import make_cluster
from slipstream.plan.model import resolve_model
from slipstream.plan.search import evaluate, layouts
from slipstream.plan.space import Strategy, Workload, parse_layout, strategy_from_config

GPT2_8 = ["plan", "--model", "gpt2", "--gpus", "8xH100", "--seq", "1024", "--global-batch", "64"]


def _spaces():
    """Layouts of every kind the search proposes: hsdp over nodes, cp, ep, every schedule, chunk
    counts, a pinned split, SP off, the fused loss, offload, fp16 / fp32, each attention."""
    gpt2, llama, moe = resolve_model("gpt2"), resolve_model("llama-1b", seq_len=16384), resolve_model("moe-tiny")
    two_nodes = make_cluster("8xH100", nodes=2)
    yield layouts(gpt2, two_nodes, Workload(1024, 64), micro_batches=(2,))
    yield layouts(llama, two_nodes, Workload(16384, 32), micro_batches=(1,), ac=("full",), precision="fp16",
                  attention="materialized")
    yield layouts(moe, two_nodes, Workload(256, 64), micro_batches=(1,), ac=("none",), precision="fp32")
    yield layouts(gpt2, make_cluster("8xH100"), Workload(1024, 48), micro_batches=(1,), ac=("selective",),
                  pp_schedules=tuple(["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble",
                                      "zbv", "dualpipev"]), pp_virtual=(2, 3), attention="efficient")
    yield layouts(gpt2, make_cluster("6xH100", nodes=2), Workload(1024, 36), pp_layers=(3, 3, 3, 3),
                  micro_batches=(1,), ac=("none",))


def test_parse_is_the_inverse_of_label_for_every_layout_the_search_proposes():
    seen = 0
    kinds = set()
    for found in _spaces():
        labels = [s.label() for s in found]
        assert len(set(labels)) == len(labels)      # a label names one layout of a search
        for s in found:
            back = parse_layout(s.label(), s.world, s.dp * s.micro_batch * s.grad_accum, precision=s.precision,
                                attention=s.attention, n_layer=None)
            assert back == s, (s.label(), back)
            kinds.update({s.dp_strategy, s.pp_schedule, f"sp{s.sequence_parallel}", f"v{s.pp_virtual}",
                          f"cp{s.cp}", f"ep{s.ep}", f"offload{s.offload}", f"fused{s.fused_loss}", s.precision,
                          s.attention, f"layers{bool(s.pp_layers)}"})
            seen += 1
    # the generated layouts cover every token of the syntax
    assert seen > 2000
    assert {"none", "ddp", "zero1", "zero2", "fsdp", "hsdp", "spTrue", "spFalse", "cp2", "ep2", "offloadTrue",
            "fusedTrue", "fp16", "fp32", "bf16", "materialized", "efficient", "layersTrue", "v3",
            "gpipe", "zbv", "dualpipev", "looped-bfs", "interleaved-zero-bubble", "interleaved-1f1b"} <= kinds


def test_what_a_layout_leaves_out():
    s = parse_layout("tp4 pp12 zero1:8 mb2 ac:full", 384, 1920)
    assert s == Strategy("zero1", dp=8, tp=4, sequence_parallel=False, pp=12, micro_batch=2, grad_accum=120, ac="full")
    assert s.label() == "zero1:8 tp4 pp12:1f1b mb2x120 ac:full"
    # the data-parallel degree and strategy from the rest; accumulation from the global batch
    assert parse_layout("tp2+sp", 8, 64) == Strategy("ddp", dp=4, tp=2, micro_batch=1, grad_accum=16)
    assert parse_layout("pp4", 4, 16) == Strategy("none", pp=4, micro_batch=1, grad_accum=16)
    assert parse_layout("cp2", 2, 4) == Strategy("ddp", dp=1, cp=2, micro_batch=1, grad_accum=4)
    assert parse_layout("hsdp:2x8 mb4 offload", 16, 64) == Strategy("hsdp", dp=16, dp_shard=8, micro_batch=4,
                                                                     grad_accum=1, offload=True)
    assert parse_layout("pp4:zbv fsdp", 8, 16).pp_virtual == 2
    assert parse_layout("pp4:zbvx2 fsdp", 8, 16).pp_virtual == 2          # its own count may be written
    assert parse_layout("pp4:1f1bx1", 4, 16).pp_virtual == 1
    assert parse_layout("pp2:interleaved-1f1bx3", 2, 16).pp_virtual == 3  # a looping schedule takes any
    assert parse_layout("pp4:interleavedx3", 4, 16).pp_schedule == "interleaved-1f1b"   # the planner's alias
    assert parse_layout("mb2x3", 1, None) == Strategy(micro_batch=2, grad_accum=3)       # no batch: as given
    # the plan's precision and attention unless the layout names its own
    assert parse_layout("ddp:8", 8, 8, precision="fp32").precision == "fp32"
    assert parse_layout("ddp:8 fp16 attn:materialized", 8, 8).precision == "fp16"
    assert parse_layout("ddp:8 attn:efficient", 8, 8, attention="flash").attention == "efficient"
    assert parse_layout("DDP:8 FUSED-LOSS", 8, 8).fused_loss   # words in any case


@pytest.mark.parametrize("text, message", [
    ("tp4 pp12 zero1:9 mb2", "zero1:9 x tp4 x pp12 x cp1 = 432 GPUs, the cluster has 384"),
    ("tp5", "tp5 x pp1 x cp1 = 5 does not divide the 384 GPUs"),
    ("tq4", "unknown word 'tq4'"),
    ("tp4 tp2", "'tp2' names the tensor parallel again"),
    ("pp4:zb", "unknown pipeline schedule 'zb'"),
    ("hsdp:8", "hsdp needs replicas x shard"),
    ("fsdp:8x48", "only hsdp takes replicas x shard"),
    ("none", "need a data-parallel strategy"),
    ("ddp:384 offload", "offload is FSDP's CPU offload"),
    ("mb7", "global batch 1920 is not a multiple of dp 384 x micro-batch 7"),
    ("mb1x4", "= 1536 sequences per step, the global batch is 1920"),
    ("ac:most", "checkpointing is one of none, selective, full"),
    ("attn:fast", "attention is one of flash, efficient, materialized"),
    ("pp4 layers:1,2,3", "gives 3 stages, pp4 x 1 per rank has 4"),
    ("layers:1,2", "splits a pipeline: give its degree too"),
    ("tp0", "degrees and counts are at least 1"),
    # A fixed schedule's own chunk count only: the label would say x3 while the plan runs 2.
    ("pp2:zbvx3", "'pp2:zbvx3': zbv runs exactly 2 stage(s) per rank, not 3"),
    ("pp2:dualpipevx1", "dualpipev runs exactly 2 stage(s) per rank, not 1"),
    ("pp2:1f1bx2", "'pp2:1f1bx2': 1f1b runs exactly 1 stage(s) per rank, not 2"),
    ("pp4:gpipex4", "gpipe runs exactly 1 stage(s) per rank, not 4"),
    ("", "it is empty"),
])
def test_a_bad_layout_names_the_word_and_shows_the_syntax(text, message):
    with pytest.raises(UserError) as e:
        parse_layout(text, 384, 1920)
    assert message in str(e.value) and "Syntax: a layout is words in any order" in str(e.value)


def test_a_split_must_add_up_to_the_layers():
    assert parse_layout("pp2 layers:5,7", 2, 8, n_layer=12).pp_layers == (5, 7)
    with pytest.raises(UserError, match="add up to the model's 12 layers"):
        parse_layout("pp2 layers:5,8", 2, 8, n_layer=12)


# ---------------------------------------------------------------- slipstream plan --layout

def run(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_layout_prints_that_layout_whole(capsys):
    code, out, err = run(capsys, *GPT2_8, "--layout", "fsdp:4 tp2+sp mb4 ac:full")
    assert code == 0, err
    model, cluster, work = resolve_model("gpt2"), make_cluster("8xH100"), Workload(1024, 64)
    expected = evaluate(model, Strategy("fsdp", dp=4, tp=2, micro_batch=4, grad_accum=4, ac="full"), work, cluster)
    assert "layout fsdp:4 tp2+sp mb4x4 ac:full (precision bf16, attention flash)" in out
    assert "fits:     yes" in out and "runnable: yes" in out
    assert f"{expected.time.tokens_per_s:,.0f} tokens/s" in out and "MFU (model FLOPs)" in out
    for name in ("parameters", "gradients", "optimizer state", "activations", "temporaries", "total"):
        assert f"  {name} " in out
    assert f"{expected.memory.total_bytes / 2**30:.1f}" in out and "step time, s:" in out
    # JSON: the same layout and numbers
    code, out, err = run(capsys, *GPT2_8, "--layout", "fsdp:4 tp2+sp mb4 ac:full", "--json")
    record = json.loads(out)
    assert record["evaluated"] == 1 and record["ranked"][0]["layout"] == "fsdp:4 tp2+sp mb4x4 ac:full"
    assert record["ranked"][0]["time"]["tokens_per_s"] == expected.time.tokens_per_s


def test_plan_layout_says_what_does_not_fit_or_run(capsys):
    code, out, err = run(capsys, *GPT2_8, "--layout", "zero1:4 tp2 mb16", "--memory-gib", "1")
    assert code == 0, err
    assert "fits:     no: needs" in out and "runnable: no: slipstream cannot run tensor parallel 2 with zero1" in out
    # a layout the model cannot take: the search's reason, as a user error
    code, out, err = run(capsys, *GPT2_8, "--layout", "tp8")
    assert code == 2 and "tp8 does not divide the model's 12 heads" in err


def test_plan_layout_errors(capsys):
    code, out, err = run(capsys, *GPT2_8, "--layout", "tp2 bogus")
    assert code == 2 and err.startswith("error: ") and "unknown word 'bogus'" in err and "Syntax:" in err
    code, out, err = run(capsys, *GPT2_8, "--layout", "tp2", "--tp", "2", "--sequence-parallel", "off")
    assert code == 2 and "--layout pins the whole layout; drop --tp, --sequence-parallel" in err


def test_plan_layout_writes_its_config(tmp_path, capsys):
    path = tmp_path / "pinned.toml"
    code, out, err = run(capsys, "plan", "--model", "llama-1b", "--gpus", "8xH100", "--seq", "2048",
                         "--global-batch", "32", "--layout", "fsdp:2 pp4:interleaved-1f1bx3 mb1 ac:full",
                         "--write-config", path)
    assert code == 0, err
    cfg = load_config(str(path))
    s = strategy_from_config(cfg, 8)
    assert s.label() == "fsdp:2 pp4:interleaved-1f1bx3 mb1x16 ac:full"   # 12 stages of 16 layers: uneven
    assert cfg.parallel.pp_virtual_stages == 3 and cfg.parallel.pp_layers == ""


def test_plan_search_flags_reach_the_search(capsys):
    code, out, err = run(capsys, *GPT2_8, "--tp", "2", "--pp", "1", "--sequence-parallel", "off", "--fused-loss", "off",
                         "--top", "50", "--json")
    assert code == 0, err
    labels = [r["layout"] for r in json.loads(out)["ranked"]]
    assert labels and all(" tp2 " in f" {label} " and "+sp" not in label and "fused-loss" not in label
                          for label in labels)
    code, out, err = run(capsys, "plan", "--model", "llama-1b", "--gpus", "8xH100", "--seq", "2048",
                         "--global-batch", "32", "--pp", "4", "--pp-virtual", "3", "--pp-schedule", "interleaved",
                         "--tp", "1", "--json", "--top", "200")
    assert code == 0, err
    ranked = json.loads(out)["ranked"]
    assert {r["strategy"]["pp_virtual"] for r in ranked if r["strategy"]["pp_schedule"] == "interleaved-1f1b"} == {3}
    code, out, err = run(capsys, "plan", "--model", "llama-1b", "--gpus", "8xH100", "--seq", "2048",
                         "--global-batch", "32", "--pp-layers", "4,4,4,4", "--tp", "1", "--json", "--top", "500")
    ranked = json.loads(out)["ranked"]
    assert code == 0 and all(tuple(r["strategy"]["pp_layers"]) == (4, 4, 4, 4) for r in ranked
                             if r["strategy"]["pp"] > 1)
    code, out, err = run(capsys, *GPT2_8, "--pp-layers", "4,x")
    assert code == 2 and "--pp-layers '4,x'" in err
    code, out, err = run(capsys, *GPT2_8, "--attention", "materialized", "--top", "1")
    assert code == 0 and "attention materialized" in out
