"""Config files in, a validated TrainConfig out: YAML and dotted `key=value` overrides merged by
OmegaConf, then checked by pydantic against the schema; every error names the dotted key."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from opd_jax.config.schema import TrainConfig
from opd_jax.errors import OpdJaxError

M = TypeVar("M", bound=pydantic.BaseModel)


class ConfigError(OpdJaxError, ValueError):
    """A config that cannot be used; the message names the file or the dotted key."""


def _nearest(loc: tuple[Any, ...], schema: type[pydantic.BaseModel]) -> str:
    """' (did you mean KEY?)' for the known key closest to an unknown one, or ''."""
    from opd_jax.config.reference import key_docs  # the reference reads the schema through this module

    pattern = "".join("[]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    near = difflib.get_close_matches(pattern, [d.key for d in key_docs(schema)], n=1, cutoff=0.6)
    return f" (did you mean {near[0]}?)" if near else ""


def _describe(error: dict[str, Any], schema: type[pydantic.BaseModel], overrides: Sequence[str]) -> tuple[str, bool]:
    """One problem as 'key: what' (prefixed by the override that set the key, if one did), and
    whether an override set it. A section's own check that names one of its fields
    ('advantage: ...') is put on that field's key."""
    key = ".".join(str(part) for part in error["loc"])
    message = error["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    field, sep, rest = message.partition(": ")
    if (sep and all(part.isidentifier() for part in field.split(".")) and isinstance(error.get("input"), dict)
            and field.split(".")[0] in error["input"]):
        key, message = f"{key}.{field}" if key else field, rest
    key = key or "(top level)"
    override = next((o for o in overrides if key == o.split("=", 1)[0].strip()
                     or key.startswith(o.split("=", 1)[0].strip() + ".")
                     or o.split("=", 1)[0].strip().startswith(key + ".")), None)
    source = f"override {override!r}: " if override is not None else ""
    if error["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        return f"{source}{key}: unknown key{_nearest(error['loc'], schema)}", override is not None
    got = error.get("input")
    shown = "" if isinstance(got, dict) or f"{got!r}" in message else f" (got {got!r})"
    return f"{source}{key}: {message}{shown}", override is not None


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *,
                schema: type[M] = TrainConfig) -> M:
    """The config (a TrainConfig, or another `schema`) from a YAML file (or the defaults) with
    `overrides` such as ["algorithm.ppo.surrogate.eps_high=0.3", "rollout.samples_per_prompt=8"] applied."""
    try:
        base = OmegaConf.load(path) if path is not None else OmegaConf.create({})
        if not isinstance(base, dict) and not OmegaConf.is_dict(base):
            raise ConfigError(f"{path}: a config file must hold a mapping at the top level")
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form key.path=value")
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        raw = OmegaConf.to_container(merged, resolve=True)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        raise ConfigError(f"{path or 'overrides'}: {e}") from None
    try:
        return schema.model_validate(raw)
    except pydantic.ValidationError as e:
        described = [_describe(err, schema, overrides) for err in e.errors()]
        if len(described) == 1:  # one line: an override's problem is not blamed on the file
            problem, by_override = described[0]
            raise ConfigError(problem if by_override else f"invalid config{f' {path}' if path else ''}: {problem}") from None
        problems = "\n  ".join(problem for problem, _ in described)
        raise ConfigError(f"invalid config{f' {path}' if path else ''}:\n  {problems}") from None


def to_plain(config: Any) -> Any:
    """The config as plain YAML-able data (dataclass sections included)."""
    def plain(x):
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, pydantic.BaseModel):
            return {k: plain(getattr(x, k)) for k in type(x).model_fields}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x
    return plain(config)


def dump_config(config: pydantic.BaseModel) -> str:
    """The resolved config as YAML, every default included (what `opd-jax config show` prints)."""
    return yaml.safe_dump(to_plain(config), sort_keys=False)


def save_config(config: pydantic.BaseModel, path: str | Path) -> None:
    """Write the resolved config; load_config(path) gives it back."""
    Path(path).write_text(dump_config(config))


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b.c": value} for every leaf of nested mappings (lists are leaves)."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_changes(old_yaml: str, new: pydantic.BaseModel) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (old value, new value)} for every key whose value differs between a saved
    config (its YAML text) and `new`."""
    before, after = flatten(yaml.safe_load(old_yaml) or {}), flatten(to_plain(new))
    return {k: (before.get(k), after.get(k)) for k in sorted(before.keys() | after.keys())
            if before.get(k) != after.get(k)}


def fixed_on_resume(changes: dict[str, Any], fixed: Sequence[str]) -> list[str]:
    """The changed keys under any of the `fixed` prefixes (what a resumed run cannot change)."""
    return [k for k in changes if any(k == p or k.startswith(p + ".") for p in fixed)]
