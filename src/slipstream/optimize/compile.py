"""torch.compile, applied from outside the model (as torchtitan's `apply_compile`).

    off     eager
    model   compile the whole model as one region
    blocks  regional compile: each transformer block separately. The blocks are identical,
            so the first one's compiled code is reused by all the others: the cold compile
            does one block's work however deep the model is.

Both use the in-place `nn.Module.compile()`, not `torch.compile(module)`: the latter returns
a wrapper that puts `_orig_mod.` in front of every parameter name and state-dict key, while
in-place compile leaves names, state dicts and checkpoints exactly as in eager.

Order: apply activation checkpointing first, then compile, so that compile traces the
checkpointed regions (slipstream.optimize.activations refuses the other order).

Cold compiles are slow (tens of seconds on a 2-core CPU even for a tiny model); call
`configure_compile_cache` once before the first compile so that repeat runs reuse the
compiled code from disk (a few seconds).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.nn as nn

from slipstream.errors import UserError
from slipstream.optimize.activations import OffloadActivations
from slipstream.models.transformer import block_slots

SCOPES = ("off", "model", "blocks")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def apply_compile(model: nn.Module, scope: str, mode: str = "default", fullgraph: bool = False,
                  dynamic: bool | None = False) -> nn.Module:
    """Compile `model` (in place) over `scope`; returns `model`.

    Compilation itself is lazy: it happens on the first forward. `dynamic=False` compiles
    for the exact shapes seen (training uses one sequence length); None lets torch decide
    after it sees a second shape.
    """
    if scope not in SCOPES:
        raise UserError(f"unknown compile scope {scope!r}; valid: {', '.join(SCOPES)}")
    if mode not in MODES:
        raise UserError(f"unknown compile mode {mode!r}; valid: {', '.join(MODES)}")
    if dynamic not in (True, False, None):
        raise UserError(f"compile 'dynamic' must be true, false or unset, got {dynamic!r}")
    if scope == "off":
        return model
    options = dict(mode=mode, fullgraph=fullgraph, dynamic=dynamic)
    if scope == "model":
        model.compile(**options)
    else:
        # Each block is compiled separately; they share the compiled code because they run
        # the same forward on tensors of the same shapes.
        for _, block in block_slots(model):
            if isinstance(block, OffloadActivations):
                # Compile inside the offload wrapper: dynamo does not trace a region that
                # installs saved-tensor hooks (it falls back to eager there), while hooks
                # installed around a compiled region do apply to what it saves.
                block = block._checkpoint_wrapped_module
            # A checkpoint wrapper itself is compiled, so the recomputation is traced too.
            block.compile(**options)
    return model


def default_compile_cache_dir() -> Path:
    """`$SLIPSTREAM_CACHE_DIR/inductor`, else `~/.cache/slipstream/inductor`."""
    root = os.environ.get("SLIPSTREAM_CACHE_DIR") or Path.home() / ".cache" / "slipstream"
    return Path(root) / "inductor"


def configure_compile_cache(cache_dir: str | os.PathLike | None = None) -> Path:
    """Keep inductor's compiled code in `cache_dir` (default: `default_compile_cache_dir()`).

    Must be called before the first compile of the process: inductor reads
    TORCHINDUCTOR_CACHE_DIR when it first compiles and keeps some paths from then on. Without
    this, the cache lives in a temp folder (`/tmp/torchinductor_<user>`) shared by every
    process of the user and lost on reboot. With a warm cache a repeat run of the same model
    skips both the graph compilation (FX graph cache) and the C++/Triton kernel builds.
    Returns the folder used.
    """
    path = Path(cache_dir).expanduser() if cache_dir else default_compile_cache_dir()
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    # Both are on by default in recent torch; set them explicitly because the warm start is
    # this function's whole point. The FX graph cache keeps inductor's output per graph; the
    # AOTAutograd cache sits in front of it and also skips the forward/backward split on a hit.
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return path
