"""Imports point down only: every module of src/slipstream has a layer, and no import statement
(module level or inside a function) reaches a higher layer. Same-layer imports are allowed.

The layers of DESIGN.md ("Layers (imports point down only)"), lowest first:

    0 base        config/, runtime, errors, safe_read, diskspace, outputs
                  (schema, load, validation, parallel degrees; device, seeds, threads;
                  bounded readers, disk-full errors, named output files)
    1 blocks      models/, data/, plan/ (the estimators)            pure building blocks
    2 components  distributed/, optimize/, observe/, ops/            parallelize chain, apply_*,
                                                                     metrics, loggers, profiler
    3 services    checkpoint/, resilience/                           save/load/reshard; guards
    4 train       train/                                             the Trainer, the LM job, resume
    5 tools       perf/, tune/, report/, plan.accuracy,              tools that run the trainer
                  plan.accuracy_measure, plan.render, plan.report    (or read its run dirs for the CLI)
    6 cli         cli/, slipstream.__main__, slipstream (the package facade that exports Trainer;
                  `from slipstream import __version__` is metadata any layer may read)

A module takes its package's layer unless MODULE_LAYERS names it. A module that is in no
layer fails the test (a new package must be placed in the table first). KNOWN_UPWARD lists
the few upward edges still to be moved, each with where its code belongs; an edge listed
there that no longer exists fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "slipstream"

LAYERS = ("base", "blocks", "components", "services", "train", "tools", "cli")

# Top-level packages and modules of slipstream -> layer.
PACKAGE_LAYERS = {
    "config": "base", "runtime": "base", "errors": "base", "safe_read": "base", "diskspace": "base",
    "outputs": "base", "memtrack": "base",
    "models": "blocks", "data": "blocks", "plan": "blocks",
    "distributed": "components", "optimize": "components", "observe": "components", "ops": "components",
    "checkpoint": "services", "resilience": "services",
    "train": "train",
    "perf": "tools", "tune": "tools", "report": "tools",
    "cli": "cli", "__main__": "cli",
}

# Modules whose layer is not their package's (most specific name wins).
MODULE_LAYERS = {
    "slipstream": "cli",               # the package facade: lazy `slipstream.Trainer`
    "slipstream.plan.accuracy": "tools",  # measures real steps against the estimators
    "slipstream.plan.accuracy_measure": "tools",  # runs those steps (models, optimize, distributed, observe)
    "slipstream.plan.render": "tools",  # tables and files of `slipstream plan`; only the CLI uses it
    "slipstream.plan.report": "tools",  # calibration against published runs and finished run dirs (CLI)
}

# (importing module, imported module) edges that still point up; each names where it belongs.
# None left: the GPU datasheet table moved down to plan/gpus.py (observe/peaks.py reads it), and a
# `cpu` cluster gets this machine's name and measured peak from its caller (observe.peaks.this_cpu()).
KNOWN_UPWARD: set[tuple[str, str]] = set()

# Names of the root package that every layer may import: metadata, not the lazy Trainer facade.
ROOT_METADATA = {"__version__"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    """The layer of a slipstream module name, or None if the table does not place it."""
    parts = module.split(".")
    if module in MODULE_LAYERS:
        return MODULE_LAYERS[module]
    for n in range(len(parts) - 1, 1, -1):  # an enclosing package named in MODULE_LAYERS
        name = ".".join(parts[:n])
        if name in MODULE_LAYERS:
            return MODULE_LAYERS[name]
    if len(parts) >= 2:
        return PACKAGE_LAYERS.get(parts[1])
    return None


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _imports(module: str, path: Path, known: set[str]):
    """(line, imported slipstream module) for every import statement, at any depth."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            if target == PACKAGE and {a.name for a in node.names} <= ROOT_METADATA:
                continue
            # `from slipstream.observe import env` imports the submodule slipstream.observe.env.
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            if len(subs) < len(node.names):
                yield node.lineno, target
            for sub in subs:
                yield node.lineno, sub


def upward_imports(modules: dict[str, Path]) -> list[tuple[str, int, str, str, str, str]]:
    """(file, line, module, its layer, imported module, its layer) for each import that points up."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    known = set(modules)
    found = []
    for module, path in modules.items():
        mine = layer_of(module)
        for line, target in _imports(module, path, known):
            theirs = layer_of(target)
            if mine is None or theirs is None:
                continue  # reported by the unassigned-module test
            if rank[theirs] > rank[mine]:
                found.append((str(path.relative_to(SRC.parent)), line, module, mine, target, theirs))
    return found


def test_every_module_has_a_layer():
    unassigned = [m for m in _modules() if layer_of(m) is None]
    assert not unassigned, ("modules in no layer (add their package to PACKAGE_LAYERS or the module to "
                            f"MODULE_LAYERS in {Path(__file__).name}): {unassigned}")
    assert set(PACKAGE_LAYERS.values()) | set(MODULE_LAYERS.values()) <= set(LAYERS)


def test_imports_point_down_only():
    found = upward_imports(_modules())
    new = [f for f in found if (f[2], f[4]) not in KNOWN_UPWARD]
    assert not new, "imports that point up:\n" + "\n".join(
        f"  {file}:{line}: {mod} ({layer}) imports {target} ({their})"
        for file, line, mod, layer, target, their in new)
    gone = set(KNOWN_UPWARD) - {(f[2], f[4]) for f in found}
    assert not gone, f"fixed upward imports still listed in KNOWN_UPWARD (remove them): {sorted(gone)}"


def test_the_check_sees_function_local_and_submodule_imports(tmp_path):
    """The scanner itself: an upward import inside a function, written as `from pkg import module`,
    is found with its line."""
    pkg = tmp_path / "slipstream"
    (pkg / "config").mkdir(parents=True)
    (pkg / "train").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "__init__.py").write_text("")
    (pkg / "train" / "__init__.py").write_text("")
    (pkg / "train" / "lm.py").write_text("")
    (pkg / "config" / "load.py").write_text("import os\n\n\ndef f():\n    from slipstream.train import lm\n")
    global SRC
    saved, SRC = SRC, tmp_path
    try:
        found = upward_imports(_modules())
    finally:
        SRC = saved
    assert [(f[1], f[2], f[3], f[4], f[5]) for f in found] == [
        (5, "slipstream.config.load", "base", "slipstream.train.lm", "train")]
