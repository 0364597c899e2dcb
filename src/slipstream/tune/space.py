"""The search space of `slipstream tune hparams`: `[tune.space]` read, checked and turned into
Optuna distributions.

    [tune.space]
    optim.lr = {log_uniform = [1e-4, 1e-2]}
    optim.weight_decay = {uniform = [0.0, 0.2]}
    optim.warmup_steps = {int = [0, 100], step = 10}
    train.micro_batch_size = {log_int = [4, 32]}
    optim.schedule = {choices = ["cosine", "wsd"]}
    optim.decay_fraction = {uniform = [0.1, 0.3], when = {"optim.schedule" = "wsd"}}

A key is a config key (`section.field`, or `section.table.entry` for a table field). TOML reads
the dotted keys above as nested tables ({"optim": {"lr": {...}}}) while an override
`--tune.space.optim.lr={log_uniform=[1e-4,1e-2]}` arrives as {"optim.lr": {...}}; both are
flattened here, and the later entry (the override) wins. `when` makes a parameter conditional:
it is sampled only when every named key has its value in this trial (the sampled value when
that key is in the space too, else the config's).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from slipstream.config.schema import Config, sections
from slipstream.errors import UserError

TYPES = ("log_uniform", "uniform", "int", "log_int", "choices")
EXAMPLES = {
    "log_uniform": "optim.lr = {log_uniform = [1e-4, 1e-2]}",
    "uniform": "optim.weight_decay = {uniform = [0.0, 0.2]}",
    "int": "optim.warmup_steps = {int = [0, 100], step = 10}",
    "log_int": "train.micro_batch_size = {log_int = [4, 32]}",
    "choices": 'optim.schedule = {choices = ["cosine", "wsd"]}',
    "when": 'optim.decay_fraction = {uniform = [0.1, 0.3], when = {"optim.schedule" = "wsd"}}',
}
# Keys the tuner sets itself for every trial (where it runs, what it saves, its data) or that
# configure the tuner: tuning them would be meaningless or break the study.
RESERVED = ("run.dir", "data.dir", "checkpoint.resume", "checkpoint.save_final", "checkpoint.interval",
            "checkpoint.interval_minutes", "logging.progress", "resilience.preemption")


@dataclasses.dataclass(frozen=True)
class Param:
    """One dimension of the space. low/high/step for ranges, choices for `choices`, when: the
    (key, value) pairs that must all hold for it to be sampled."""

    key: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    step: float | int | None = None
    choices: tuple = ()
    when: tuple[tuple[str, Any], ...] = ()

    def distribution(self):
        """The Optuna distribution this parameter is sampled from."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind == "choices":
            return CategoricalDistribution(self.choices)
        if self.kind in ("int", "log_int"):
            return IntDistribution(self.low, self.high, log=self.kind == "log_int", step=self.step or 1)
        return FloatDistribution(self.low, self.high, log=self.kind == "log_uniform", step=self.step)

    def to_spec(self) -> dict[str, Any]:
        """The normalized `[tune.space]` entry (what study.json records; parse_space reads it back)."""
        spec: dict[str, Any] = {self.kind: list(self.choices) if self.kind == "choices" else [self.low, self.high]}
        if self.step is not None:
            spec["step"] = self.step
        if self.when:
            spec["when"] = dict(self.when)
        return spec


def _is_spec(value: dict) -> bool:
    """A spec table (it names a type, `step` or `when`, or holds a non-table value), not a level of nesting."""
    return (any(k in TYPES or k in ("step", "when") for k in value)
            or any(not isinstance(v, dict) for v in value.values()))


def flatten_space(raw: dict[str, Any]) -> dict[str, Any]:
    """{"optim": {"lr": SPEC}, "optim.lr": SPEC2} -> {"optim.lr": SPEC2}: dotted keys at any
    depth joined; a later entry replaces an earlier one with the same key (overrides come last)."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, table: dict[str, Any]) -> None:
        for name, value in table.items():
            key = f"{prefix}.{name}" if prefix else str(name)
            if isinstance(value, dict) and value and not _is_spec(value):
                walk(key, value)
            else:
                flat.pop(key, None)  # re-inserted last: the override's place in the order
                flat[key] = value

    if not isinstance(raw, dict):
        raise UserError(f"tune.space must be a table of config key -> range, e.g. {EXAMPLES['log_uniform']}")
    walk("", raw)
    return flat


def field_type(key: str) -> Any:
    """The declared type of a config key (`section.field`, or `section.table.entry`); UserError
    naming the key when the config has no such key."""
    parts = key.split(".")
    known = sections()
    if len(parts) < 2 or parts[0] not in known:
        raise UserError(f"tune.space.{key}: not a config key; name one as section.field, e.g. "
                        f"{EXAMPLES['log_uniform']} (sections: {', '.join(known)})")
    types = typing.get_type_hints(known[parts[0]])
    name = parts[1]
    if name not in types:
        raise UserError(f"tune.space.{key}: the config has no key '{parts[0]}.{name}' (`slipstream config reference` "
                        f"lists them); e.g. {EXAMPLES['log_uniform']}")
    typ = types[name]
    if len(parts) == 2:
        return typ
    if len(parts) == 3 and typing.get_origin(typ) is dict:
        return typing.get_args(typ)[1]
    raise UserError(f"tune.space.{key}: '{parts[0]}.{name}' is not a table, so '{key}' names nothing; "
                    f"write {parts[0]}.{name} = {{...}}")


def config_value(cfg: Config, key: str) -> Any:
    """The value a config key has in `cfg` (None for a table entry it does not hold)."""
    section, name, *entry = key.split(".")
    value = getattr(getattr(cfg, section), name)
    return value.get(entry[0]) if entry else value


def override_arg(key: str, value: Any) -> str:
    """`--key=value` as `slipstream train` parses it back to the same value (floats by repr: exact)."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    else:
        text = value if isinstance(value, str) else repr(value)
    return f"--{key}={text}"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _parse_one(key: str, spec: Any) -> Param:
    """One spec table -> Param; every malformed spec is a UserError naming the key and an example."""
    where = f"tune.space.{key}"
    if not isinstance(spec, dict):
        raise UserError(f"{where} = {spec!r}: expected a range table, e.g. {EXAMPLES['log_uniform']} "
                        f"or {EXAMPLES['choices']}")
    kinds = [k for k in spec if k in TYPES]
    unknown = [k for k in spec if k not in TYPES and k not in ("step", "when")]
    if unknown:
        raise UserError(f"{where}: unknown spec key '{unknown[0]}'; a spec has one of {', '.join(TYPES)} "
                        f"(plus step, when), e.g. {EXAMPLES['int']}")
    if len(kinds) != 1:
        raise UserError(f"{where}: give exactly one of {', '.join(TYPES)} (got {', '.join(kinds) or 'none'}), "
                        f"e.g. {EXAMPLES['log_uniform']}")
    kind = kinds[0]
    when = spec.get("when", {})
    if "when" in spec and (not isinstance(when, dict) or not when):
        raise UserError(f"{where}: when must be a table of config key = value, e.g. {EXAMPLES['when']}")
    value, example = spec[kind], EXAMPLES[kind]
    if kind == "choices":
        if not isinstance(value, list) or not value:
            raise UserError(f"{where}: choices must be a non-empty list, e.g. {example}")
        if not all(isinstance(v, (str, int, float, bool)) for v in value):
            raise UserError(f"{where}: choices must be strings, numbers or booleans, e.g. {example}")
        # Equal values of different types (1, 1.0, true) are one choice to Optuna: the storage
        # keeps a choice's index, found by ==, so the study would record 1 for a sampled 1.0.
        if any(a == b for i, a in enumerate(value) for b in value[i + 1:]):
            raise UserError(f"{where}: choices {value!r} repeat a value (1, 1.0 and true count as one); list each "
                            f"once, e.g. {example}")
        if "step" in spec:
            raise UserError(f"{where}: step applies to int and uniform ranges, not choices; e.g. {EXAMPLES['int']}")
        return Param(key, kind, choices=tuple(value), when=tuple(when.items()))
    integer = kind in ("int", "log_int")
    if (not isinstance(value, list) or len(value) != 2 or not all(_number(v) for v in value)
            or (integer and not all(isinstance(v, int) for v in value))):
        what = "integers" if integer else "numbers"
        raise UserError(f"{where} = {{{kind} = {value!r}}}: expected [low, high], two {what}, e.g. {example}")
    low, high = value
    if low > high:
        raise UserError(f"{where}: the range [{low}, {high}] has low > high; write [{high}, {low}]")
    if kind.startswith("log_") and low <= 0:
        raise UserError(f"{where}: a {kind} range needs low > 0 (got {low}); e.g. {example}")
    step = spec.get("step")
    if step is not None:
        if kind.startswith("log_"):
            raise UserError(f"{where}: step cannot be combined with {kind} (log ranges have no step); "
                            f"use int or uniform with step, e.g. {EXAMPLES['int']}")
        if not _number(step) or step <= 0 or (integer and not isinstance(step, int)):
            raise UserError(f"{where}: step must be a positive {'integer' if integer else 'number'} (got {step!r}); "
                            f"e.g. {EXAMPLES['int']}")
    if not integer:
        low, high = float(low), float(high)
        step = None if step is None else float(step)
    return Param(key, kind, low, high, step, when=tuple(when.items()))


def _check_field(param: Param, typ: Any) -> None:
    """The range's type fits the key's: a float range over an integer key would sample 3.7."""
    where = f"tune.space.{param.key}"
    if param.kind in ("uniform", "log_uniform") and typ is not float:
        hint, example = ("int = [a, b] or log_int = [a, b]", EXAMPLES["int"]) if typ is int else \
            ("choices = [...]", EXAMPLES["choices"])
        raise UserError(f"{where}: {param.kind} samples real numbers but this key takes "
                        f"{getattr(typ, '__name__', typ)}; use {hint}, e.g. {example}")
    if param.kind in ("int", "log_int") and typ not in (int, float):
        raise UserError(f"{where}: {param.kind} samples integers but this key takes {getattr(typ, '__name__', typ)}; "
                        f"use choices = [...], e.g. {EXAMPLES['choices']}")


def check_values(space: dict[str, Param], config_path, overrides: list[str]) -> None:
    """Each end of each range and each choice must pass the config's own validation, alone on
    top of the base config (load_config with that override): a bad range fails here, before
    any trial, with the config's reason. Combinations are checked per trial."""
    from slipstream.config import load_config

    for param in space.values():
        values = param.choices if param.kind == "choices" else (param.low, param.high)
        for value in values:
            try:
                load_config(config_path, [*overrides, override_arg(param.key, value)])
            except UserError as e:
                raise UserError(f"tune.space.{param.key}: the value {value!r} is refused by the config ({e}); "
                                "narrow the range or change the base config") from None


def _can_take(param: Param, value: Any) -> bool:
    """Whether `param` can be sampled at `value` (a `when` naming another value never holds)."""
    if param.kind == "choices":
        return value in param.choices  # by ==, as `active` compares
    if not _number(value) or (param.kind in ("int", "log_int") and value != int(value)):
        return False
    return param.low <= value <= param.high


def order_by_condition(space: dict[str, Param]) -> list[Param]:
    """The parameters in an order where every `when` key of the space comes before the
    parameters that depend on it; a cycle is a UserError."""
    done: dict[str, Param] = {}
    visiting: list[str] = []

    def visit(param: Param) -> None:
        if param.key in done:
            return
        if param.key in visiting:
            cycle = " -> ".join([*visiting[visiting.index(param.key):], param.key])
            raise UserError(f"tune.space: the when conditions depend on each other in a cycle ({cycle}); "
                            "make one of them unconditional")
        visiting.append(param.key)
        for key, _ in param.when:
            if key in space:
                visit(space[key])
        visiting.pop()
        done[param.key] = param

    for param in space.values():
        visit(param)
    return list(done.values())


def parse_space(raw: dict[str, Any], cfg: Config, config_path=None, overrides: list[str] | None = None
                ) -> dict[str, Param]:
    """`tune.space` (nested and/or dotted) -> {key: Param}, every key and spec checked (see the
    module doc). With `config_path` the ranges' ends are also checked by the config's validation."""
    space: dict[str, Param] = {}
    for key, spec in flatten_space(raw).items():
        if key.split(".")[0] == "tune" or key in RESERVED:
            raise UserError(f"tune.space.{key}: the tuner sets this key itself for every trial (or it configures "
                            f"the tuner); tune a training setting instead, e.g. {EXAMPLES['log_uniform']}")
        typ = field_type(key)
        param = _parse_one(key, spec)
        _check_field(param, typ)
        space[key] = param
    for param in space.values():
        for key, value in param.when:
            field_type(key)  # a real config key (UserError otherwise)
            other = space.get(key)
            # (A conditional parent left out of a trial has the config's value there.)
            if other is not None and not _can_take(other, value) and not (
                    other.when and config_value(cfg, key) == value):
                sampled = (list(other.choices) if other.kind == "choices" else
                           f"{other.kind} [{other.low}, {other.high}]")
                raise UserError(f"tune.space.{param.key}: when = {{\"{key}\" = {value!r}}} can never hold: "
                                f"{key} is sampled from {sampled!r}")
    order_by_condition(space)
    if config_path is not None:
        check_values(space, config_path, list(overrides or []))
    return space


def default_space(cfg: Config) -> dict[str, Param]:
    """The space of an empty `[tune.space]`: the learning rate a decade either side of the
    config's, and the weight decay over [0, 0.2] (the schema documents this). The learning rate
    stays at or above optim.min_lr, which the config requires (below it a trial would fail)."""
    lr = cfg.optim.lr
    return {"optim.lr": Param("optim.lr", "log_uniform", max(lr / 10, cfg.optim.min_lr), lr * 10),
            "optim.weight_decay": Param("optim.weight_decay", "uniform", 0.0, 0.2)}


def resolve_space(cfg: Config, config_path=None, overrides: list[str] | None = None) -> tuple[dict[str, Param], bool]:
    """The space a study searches and whether it is the default one (an empty tune.space)."""
    if not cfg.tune.space:
        return default_space(cfg), True
    return parse_space(cfg.tune.space, cfg, config_path, overrides), False


def active(param: Param, params: dict[str, Any], cfg: Config) -> bool:
    """Whether a conditional parameter is sampled, given the values chosen so far."""
    return all((params[key] if key in params else config_value(cfg, key)) == value for key, value in param.when)


def suggest(trial, space: dict[str, Param], cfg: Config) -> dict[str, Any]:
    """Sample one trial's parameters through Optuna (conditions in dependency order)."""
    params: dict[str, Any] = {}
    for param in order_by_condition(space):
        if active(param, params, cfg):
            params[param.key] = _suggest(trial, param)
    return params


def _suggest(trial, param: Param) -> Any:
    if param.kind == "choices":
        return trial.suggest_categorical(param.key, list(param.choices))
    if param.kind in ("int", "log_int"):
        return trial.suggest_int(param.key, param.low, param.high, step=param.step or 1, log=param.kind == "log_int")
    return trial.suggest_float(param.key, param.low, param.high, step=param.step, log=param.kind == "log_uniform")


def grid_values(param: Param, points: int) -> list[Any]:
    """The values the grid sampler tries: every choice; every step of an int range; `points`
    values of a float range (evenly spaced, log-spaced for log ranges) or a log_int range
    (log-spaced, rounded, without repeats); a float range with a step takes its steps."""
    if param.kind == "choices":
        return list(param.choices)
    low, high = param.low, param.high
    if param.kind == "int" or (param.kind == "uniform" and param.step):
        step = param.step or 1
        count = int(math.floor((high - low) / step + 1e-9)) + 1
        return [low + i * step for i in range(count)]
    if low == high:
        return [low]
    if param.kind == "uniform":
        values = [low + (high - low) * i / (points - 1) for i in range(points)]
    else:
        values = [low * (high / low) ** (i / (points - 1)) for i in range(points)]
    values[0], values[-1] = low, high  # exact ends, whatever the rounding
    if param.kind == "log_int":
        return sorted({int(round(v)) for v in values})
    return values


def grid_search_space(space: dict[str, Param], points: int) -> dict[str, list[Any]]:
    return {key: grid_values(param, points) for key, param in space.items()}


def space_to_json(space: dict[str, Param]) -> dict[str, dict[str, Any]]:
    return {key: param.to_spec() for key, param in space.items()}


def describe(space: dict[str, Param]) -> str:
    """One line per parameter, for the console: `optim.lr  log_uniform [0.0001, 0.01]`."""
    lines = []
    for key, param in space.items():
        what = repr(list(param.choices)) if param.kind == "choices" else f"[{param.low:g}, {param.high:g}]"
        step = f" step {param.step:g}" if param.step else ""
        when = " when " + ", ".join(f"{k} = {v!r}" for k, v in param.when) if param.when else ""
        lines.append(f"  {key}  {param.kind} {what}{step}{when}")
    return "\n".join(lines)
