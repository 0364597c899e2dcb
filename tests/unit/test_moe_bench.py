"""`slipstream bench moe`'s own arithmetic and refusals (the bench itself runs as a CLI command)."""

from __future__ import annotations

import json

import pytest

from slipstream.errors import UserError
from slipstream.perf.moe_bench import _dispatch_share, run_moe_bench


def test_dispatch_share_is_all_to_all_time_over_the_profiled_steps(tmp_path):
    trace = tmp_path / "rank0.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"name": "ProfilerStep#4", "dur": 1000}, {"name": "ProfilerStep#5", "dur": 3000},
        {"name": "gloo:all_to_all", "dur": 300}, {"name": "gloo:all_to_all", "dur": 500},
        {"name": "gloo:all_reduce", "dur": 900},  # not the dispatch
        {"name": "ncclDevKernel_AllToAll_RING", "dur": 200},  # a CUDA trace's all-to-all kernel
    ]}))
    assert _dispatch_share(trace) == pytest.approx((300 + 500 + 200) / 4000)
    assert _dispatch_share(tmp_path / "missing.json") is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(size="ci"), "--size ci needs --out"),
    (dict(size="huge"), "unknown --size 'huge'"),
    (dict(steps=3, out="x.json"), "--steps must be >= 6"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(UserError, match=message):
        run_moe_bench(**kwargs)
