"""A user nn.Module under tensor parallelism through its own `tensor_parallel_plan` (issue 13):
tp 2 (plain, and sequence + loss parallel) against one process at the same batch: logged losses,
every gradient of one step, every parameter after its AdamW step, and the layout the plan made.
Bad plans are refused with the fix in the message."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from slipstream.config import load_config
from slipstream.errors import UserError
from tests.distributed import user_tp_worker as w
from tests.distributed.test_tensor_parallel import GRAD_RTOL, LOSS_RTOL, STEP_PARAM_ATOL


@pytest.fixture(scope="module")
def launch(shared_launches) -> Path:
    """The folder of user_tp_worker.py's scenarios in the shared launch at world 2 (tests/distributed/conftest.py)."""
    part = shared_launches.part(2, "user_tp")
    part.check()
    return part.out


def _logged(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize("name", list(w.SCENARIOS))
def test_user_plan_at_tp2_equals_one_process(launch, name, tmp_path):
    torch.set_num_threads(1)
    ref_step, _ = w.run(load_config(None, w.overrides(tmp_path / "ref", 1, [])))
    got = launch / name

    got_logged, ref_logged = _logged(got / "run"), _logged(tmp_path / "ref")
    assert [r["step"] for r in got_logged] == list(range(1, w.STEPS + 1))
    for g, r in zip(got_logged, ref_logged, strict=True):
        assert math.isclose(g["loss"], r["loss"], rel_tol=LOSS_RTOL), (g["step"], g["loss"], r["loss"])

    step = torch.load(got / "step.pt", weights_only=True)
    assert math.isclose(step["loss"], ref_step["loss"], rel_tol=LOSS_RTOL)
    assert step["grads"].keys() == ref_step["grads"].keys()
    largest = max(t.abs().max().item() for t in ref_step["grads"].values())
    for n, want in ref_step["grads"].items():
        assert (step["grads"][n] - want).abs().max().item() <= GRAD_RTOL * largest, n
    for n, want in ref_step["params"].items():
        assert (step["params"][n] - want).abs().max().item() <= STEP_PARAM_ATOL, n

    # The plan took effect: the splits and the shard shapes, the replicated norm, the head's output.
    layout = json.loads((got / "layout.json").read_text())
    assert layout["emb.weight"] == {"placements": ["S(0)"], "local_shape": [w.VOCAB // 2, w.WIDTH]}
    assert layout["up.weight"] == {"placements": ["S(0)"], "local_shape": [w.HIDDEN // 2, w.WIDTH]}
    assert layout["down.weight"] == {"placements": ["S(1)"], "local_shape": [w.WIDTH, w.HIDDEN // 2]}
    assert layout["norm.weight"] == {"placements": ["R"], "local_shape": [w.WIDTH]}
    loss_parallel = "--parallel.loss_parallel=true" in w.SCENARIOS[name]
    assert layout["_head_out"] == (["S(2)", w.VOCAB // 2] if loss_parallel else [w.VOCAB])


def test_a_plan_that_leaves_a_parameter_whole_is_refused(launch):
    error = json.loads((launch / "incomplete_plan.json").read_text())["error"]
    assert error == ("IncompletePlan.tensor_parallel_plan() leaves 2 parameter(s) outside the tp mesh: norm.weight, "
                     "norm.bias. Give their modules a style; for ones that stay whole use "
                     "slipstream.distributed.tensor_parallel.ReplicateParallel()")


class _Planned(w.TinyLM):
    def __init__(self, plan):
        super().__init__()
        self._plan = plan

    def tensor_parallel_plan(self, sequence_parallel, loss_parallel):
        return self._plan


def _plan_error(plan) -> str:
    from slipstream.distributed.tensor_parallel import apply_tensor_parallel

    with pytest.raises(UserError) as info:  # refused before the mesh is touched (None here)
        apply_tensor_parallel(_Planned(plan), None, load_config(None, ["--parallel.tp=2"]))
    return str(info.value)


def test_bad_plans_are_refused_with_the_fix():
    from torch.distributed.tensor.parallel import ColwiseParallel

    assert "returned NoneType; it must return a non-empty dict {module path: ParallelStyle}" in _plan_error(None)
    assert "returned dict; it must return a non-empty dict" in _plan_error({})
    message = _plan_error({"up": "colwise"})
    assert "tensor_parallel_plan()['up'] is str, not a ParallelStyle" in message
    message = _plan_error({"upp": ColwiseParallel()})  # a typo would silently leave `up` whole
    assert "names 'upp', which is no module of the model; its modules are: emb, up, down, norm, head" in message


def test_replicate_parallel_is_public_and_one_class():
    from torch.distributed.tensor.parallel.style import ParallelStyle

    from slipstream.distributed import tensor_parallel

    assert tensor_parallel.ReplicateParallel is tensor_parallel.ReplicateParallel
    assert issubclass(tensor_parallel.ReplicateParallel, ParallelStyle)
    with pytest.raises(AttributeError):
        tensor_parallel.NoSuchStyle  # noqa: B018
