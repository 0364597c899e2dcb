"""End to end through the real CLI entry point (in process, like test_tune_system): `slipstream plan`
and `slipstream cost`, their JSON, --write-config, and user errors (exit 2, `error: ...` on stderr)."""

import json
import re

import pytest

from slipstream.cli import main
from slipstream.config import load_config

GPT2_PLAN = ["plan", "--model", "gpt2", "--gpus", "1xH100", "--seq", "1024", "--global-batch", "64"]


def run(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_table(capsys):
    code, out, err = run(capsys, *GPT2_PLAN, "--top", "3")
    assert code == 0, err
    assert "tokens/s" in out and "MFU" in out and "GiB/GPU" in out
    assert "gpt2 on 1 x NVIDIA H100 SXM" in out and "78.0 GiB usable per GPU" in out
    assert "seq 1024, global batch 64 sequences = 65,536 tokens per step" in out
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+\s+none ", line)]
    assert len(rows) == 3                              # --top 3
    assert all(line.rstrip().endswith("yes") for line in rows)
    speeds = [float(re.search(r"\s([\d,]{5,})\s", line).group(1).replace(",", "")) for line in rows]
    assert speeds == sorted(speeds, reverse=True) and speeds[0] > 1e5
    best = [line for line in out.splitlines() if line.startswith("best: ")]
    assert len(best) == 1 and best[0].startswith("best: none ") and "compute" in best[0] and "optimizer" in best[0]
    step = float(re.search(r"step ([\d.]+)s", best[0]).group(1))
    parts = [float(x) for x in re.findall(r"(?:compute|optimizer) ([\d.]+)s", best[0])]
    assert step == pytest.approx(sum(parts), abs=0.002)


def test_plan_json(capsys):
    code, out, err = run(capsys, *GPT2_PLAN, "--top", "4", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["model"] == "gpt2" and data["workload"] == {"seq_len": 1024, "global_batch": 64}
    assert data["cluster"]["gpus_per_node"] == 1 and data["cluster"]["memory_gib"] == pytest.approx(78.0)
    assert data["evaluated"] == 42 and data["feasible"] == 42
    assert 1 <= len(data["ranked"]) <= 4 and len(data["ranked"]) == 4
    assert data["rejected"] == [] and data["wrote"] is None
    speeds = [c["time"]["tokens_per_s"] for c in data["ranked"]]
    assert speeds == sorted(speeds, reverse=True)
    for c in data["ranked"]:
        assert c["fits"] is True and c["runnable"] is True and c["strategy"]["dp_strategy"] == "none"
        assert 0 < c["memory"]["total_bytes"] <= 78 * 2**30
        assert c["memory"]["total_bytes"] == c["memory"]["peak_bytes"] + c["memory"]["fragmentation_bytes"]
        t = c["time"]
        assert t["step_s"] == pytest.approx(sum(t["breakdown_s"].values()), rel=1e-4)
        assert t["tokens_per_s"] == pytest.approx(65536 / t["step_s"], rel=1e-9)
        assert 0 < t["mfu"] < 1


def test_plan_json_rejected_on_a_big_model(capsys):
    code, out, err = run(capsys, "plan", "--model", "llama-8b", "--gpus", "8xH100", "--seq", "4096",
                         "--global-batch", "64", "--runnable-only", "--top", "2", "--rejected", "3", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert len(data["ranked"]) == 2 and len(data["rejected"]) == 3
    for c in data["ranked"]:
        assert c["runnable"] and c["strategy"]["tp"] == 1 and c["strategy"]["pp"] == 1
    for c in data["rejected"]:
        assert c["fits"] is False and c["why_not"].startswith("needs ")
        assert c["memory"]["total_bytes"] > 78 * 2**30


def test_plan_write_config_loads(capsys, tmp_path):
    target = tmp_path / "sub" / "best.toml"
    code, out, err = run(capsys, *GPT2_PLAN, "--write-config", target, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["wrote"].startswith(f"wrote {target}") and "slipstream train --config" in data["wrote"]
    text = target.read_text()
    assert text.startswith("# Written by `slipstream plan`")
    best = data["ranked"][0]["strategy"]
    cfg = load_config(str(target), [])
    assert cfg.train.micro_batch_size == best["micro_batch"]
    assert cfg.train.grad_accum_steps == best["grad_accum"]
    assert cfg.train.micro_batch_size * cfg.train.grad_accum_steps == 64
    assert cfg.train.seq_len == 1024
    assert cfg.parallel.dp_strategy == best["dp_strategy"] == "none"
    assert cfg.precision.autocast == "bf16"
    assert cfg.model.n_layer == 12 and cfg.model.d_model == 768 and cfg.model.vocab_size == 50257
    assert not list(target.parent.glob(".*.tmp"))        # atomic write leaves no temporary


def test_plan_write_config_fsdp(capsys, tmp_path):
    target = tmp_path / "fsdp.toml"
    code, out, err = run(capsys, "plan", "--model", "llama-8b", "--gpus", "8xH100", "--seq", "4096",
                         "--global-batch", "64", "--dp-strategy", "fsdp", "--runnable-only",
                         "--write-config", target)
    assert code == 0, err
    assert f"wrote {target}" in out and "slipstream launch local --nproc 8" in out
    cfg = load_config(str(target), [])
    assert cfg.parallel.dp_strategy == "fsdp"
    assert cfg.parallel.param_dtype == "bf16" and cfg.parallel.reduce_dtype == "fp32"
    assert cfg.precision.autocast == "none"
    assert 8 * cfg.train.micro_batch_size * cfg.train.grad_accum_steps == 64


def test_write_config_of_an_moe_plan(capsys, tmp_path):
    target = tmp_path / "moe.toml"
    code, out, err = run(capsys, "plan", "--model", "mixtral-8x7b", "--gpus", "8xH100", "--seq", "4096",
                         "--global-batch", "64", "--write-config", target)
    assert code == 0, err
    cfg = load_config(str(target), [])
    assert (cfg.model.moe_experts, cfg.model.moe_top_k) == (8, 2) and 8 % cfg.parallel.ep == 0


def test_unknown_model_lists_known(capsys):
    code, out, err = run(capsys, "plan", "--model", "nosuchmodel", "--gpus", "1xH100", "--seq", "1024",
                         "--global-batch", "8")
    assert code == 2 and out == ""
    assert err.startswith("error: unknown model 'nosuchmodel'")
    assert "gpt2" in err and "llama-70b" in err and "mixtral-8x7b" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_unknown_gpu_lists_known(capsys):
    code, out, err = run(capsys, "plan", "--model", "gpt2", "--gpus", "1xH999", "--seq", "1024",
                         "--global-batch", "8")
    assert code == 2
    assert err.startswith("error: unknown GPU 'H999'") and "H100" in err and "A100" in err and "L4" in err


def test_nothing_fits(capsys):
    code, out, err = run(capsys, "plan", "--model", "llama-70b", "--gpus", "1xL4", "--seq", "4096",
                         "--global-batch", "8")
    assert code == 2 and out == ""
    assert err.startswith("error: nothing fits in 22.0 GiB per GPU") and "model states alone" in err


@pytest.mark.parametrize("args, message", [
    (["--seq", "4096", "--global-batch", "8"], "max_seq_len"),
    (["--seq", "1024", "--global-batch", "8", "--top", "0"], "--top must be >= 1"),
    (["--seq", "1024", "--global-batch", "0"], "global batch must be >= 1"),
    (["--seq", "1024", "--global-batch", "8", "--efficiency", "3"], "--efficiency"),
])
def test_plan_user_errors(capsys, args, message):
    code, out, err = run(capsys, "plan", "--model", "gpt2", "--gpus", "1xH100", *args)
    assert code == 2 and err.startswith("error: ") and message in err


def test_prime_batch_runnable_only(capsys):
    """7 sequences on 8 GPUs: no data parallelism divides them; a tp x pp layout runs them."""
    code, out, err = run(capsys, "plan", "--model", "gpt2", "--gpus", "8xH100", "--seq", "1024",
                         "--global-batch", "7", "--runnable-only")
    assert code == 0, err
    # gpt2's 12 blocks make 12 one-block stages over pp 4 (3 chunks per rank): the smallest bubble.
    # With and without sequence parallelism are a near tie (tp's small messages on NCCL's LL protocol).
    assert re.search(r"best: none tp2(\+sp)? pp4:interleaved-1f1bx3 mb1x7", out), out
    code, out, err = run(capsys, "plan", "--model", "gpt2", "--gpus", "8xH100", "--seq", "1024",
                         "--global-batch", "7", "--runnable-only", "--pp", "1")
    # the binding constraints named: the batch (with the reachable dp and the nearest batches), or tp8's heads
    assert code == 2 and "global batch 7 is not a multiple" in err and "reach are 2, 4, 8" in err
    assert "nearest global batches that work: 6 or 8" in err and "tp8 does not divide the model's 12 heads" in err


def test_plan_write_config_pipeline(capsys, tmp_path):
    """A pipeline plan writes the config the trainer runs: its degrees, schedule and micro-batches
    pass the trainer's own checks (issue 14)."""
    from slipstream.config.dims import check_compatibility, resolve_parallel_dims

    target = tmp_path / "pp.toml"
    code, out, err = run(capsys, "plan", "--model", "gpt2", "--gpus", "8xH100", "--seq", "1024",
                         "--global-batch", "64", "--pp", "2", "4", "--runnable-only", "--json", "--write-config", target)
    assert code == 0, err
    best = json.loads(out)["ranked"][0]["strategy"]
    assert best["pp"] > 1 and best["tp"] == best["cp"] == 1
    cfg = load_config(str(target), [])
    p = cfg.parallel
    assert (p.pp, p.pp_schedule, p.pp_microbatches, p.pp_virtual_stages) == (
        best["pp"], best["pp_schedule"], best["grad_accum"], best["pp_virtual"])
    assert (cfg.train.micro_batch_size, cfg.train.grad_accum_steps) == (best["micro_batch"], best["grad_accum"])
    check_compatibility(cfg, resolve_parallel_dims(p, 8, 8))


def test_cost_json(capsys):
    code, out, err = run(capsys, "cost", "--model", "gpt2", "--tokens", "1e9", "--gpus", "8xH100", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["seq_len"] == 1024 and data["global_batch"] == 2048   # 2^21 tokens per step
    cost = data["cost"]
    assert cost["world"] == 8 and cost["tokens"] == 1e9
    assert cost["tokens_per_s"] == pytest.approx(data["layout"]["time"]["tokens_per_s"], rel=1e-12)
    assert cost["compute_hours"] == pytest.approx(1e9 / cost["tokens_per_s"] / 3600, rel=1e-9)
    od, spot, res = cost["on_demand"], cost["spot"], cost["reserved"]
    assert od["dollars"] > res["dollars"] > spot["dollars"] > 0
    assert spot["wall_hours"] >= od["wall_hours"] >= cost["compute_hours"]
    for tier in (od, spot, res):
        assert tier["gpu_hours"] == pytest.approx(8 * tier["wall_hours"], rel=1e-12)
        assert tier["dollars"] == pytest.approx(tier["gpu_hours"] * tier["price_per_gpu_hour"], rel=1e-12)


def test_cost_given_prices(capsys):
    code, out, err = run(capsys, "cost", "--model", "gpt2", "--tokens", "1e12", "--gpus", "8xH100",
                         "--price", "2", "--spot-price", "1", "--reserved-price", "1.5", "--json")
    assert code == 0, err
    cost = json.loads(out)["cost"]
    assert (cost["prices"]["on_demand"], cost["prices"]["spot"], cost["prices"]["reserved"]) == (2.0, 1.0, 1.5)
    for tier, price in (("on_demand", 2.0), ("spot", 1.0), ("reserved", 1.5)):
        t = cost[tier]
        assert t["price_per_gpu_hour"] == price
        assert t["dollars"] == pytest.approx(t["gpu_hours"] * price, rel=1e-12)
    assert cost["reserved"]["dollars"] == pytest.approx(0.75 * cost["on_demand"]["dollars"], rel=1e-12)
    assert cost["on_demand"]["gpu_hours"] > 8 * cost["compute_hours"] * 0.999


def test_cost_table(capsys):
    code, out, err = run(capsys, "cost", "--model", "gpt2", "--tokens", "1e12", "--gpus", "8xH100",
                         "--price", "2", "--spot-price", "1", "--reserved-price", "1.5")
    assert code == 0, err
    assert "fastest layout that fits" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in
             (["on-demand"], ["spot"], ["reserved"])}
    assert lines["on-demand"][1] == "2.00" and lines["spot"][1] == "1.00" and lines["reserved"][1] == "1.50"


def test_cost_unknown_gpu(capsys):
    code, out, err = run(capsys, "cost", "--model", "gpt2", "--tokens", "1e9", "--gpus", "2xnosuchgpu")
    assert code == 2 and err.startswith("error: unknown GPU")


@pytest.mark.parametrize("extra", [[], ["--activations.checkpointing=full", "--precision.autocast=bf16"],
                                   ["--train.grad_accum_steps=2", "--train.fused_loss=true"]])
def test_every_training_run_checks_the_planner(tmp_path, tiny_overrides, extra, capsys):
    """summary.json carries the planned step peak next to the measured one (within 10 %)."""
    import json

    assert main(["train", *tiny_overrides, "--train.max_steps=3", "--train.eval_steps=0", *extra]) == 0
    memory = json.loads((tmp_path / "run" / "summary.json").read_text())["memory"]
    assert memory["planned_peak_bytes"] > 0
    assert memory["planned_error"] == pytest.approx(memory["planned_peak_bytes"] / memory["peak_bytes"] - 1)
    assert abs(memory["planned_error"]) < 0.10
    assert "planned by `slipstream plan`" in capsys.readouterr().out


def test_calibrate_from_a_finished_run(tmp_path, tiny_overrides, capsys):
    """--calibrate RUN_DIR: the run's measured tokens/s against the plan of its own config."""
    import json

    assert main(["train", *tiny_overrides, "--train.max_steps=6", "--train.eval_steps=0"]) == 0
    run = tmp_path / "run"
    capsys.readouterr()
    args = ["plan", "--model", "tiny", "--vocab", "256", "--gpus", "1xcpu", "--seq", "32", "--global-batch", "8",
            "--calibrate", str(run), "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0 < out["efficiency"] < 5 and out["efficiency"] != pytest.approx(0.87)
    # a CPU run cannot calibrate a GPU plan, and a folder that is not a run is refused
    assert main([*args[:6], "1xH100", *args[7:]]) == 2
    assert "same kind of device" in capsys.readouterr().err
    assert main([*args[:-2], str(tmp_path), "--json"]) == 2
    assert "not a finished run directory" in capsys.readouterr().err
