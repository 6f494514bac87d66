"""The config reference, made from the schema itself: every key with its type, default and the
one-line description written beside the field (an attribute docstring, which pydantic reads).
`opd-jax config explain KEY` prints one key or section; `docs/config.md` is the whole reference
(`python -m opd_jax.config.reference` writes it; a test checks it is current)."""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any

import pydantic

from opd_jax.config.load import ConfigError
from opd_jax.core.registry import ADVANTAGE_ESTIMATORS, MISMATCH_CORRECTIONS, POLICY_LOSSES, Registry

REGISTRIES = (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, MISMATCH_CORRECTIONS)


def _registry(key: str) -> Registry | None:
    """The registry whose part the key names (by the end of its dotted path), if any."""
    return next((r for r in REGISTRIES if key == r.key or key.endswith("." + r.key)), None)


def registered_parts(registry: Registry) -> str:
    """One line per registered part: its name, what it needs and its docstring's first line."""
    lines = []
    for name in registry.names():
        part = registry.get(name)
        needs = f" [needs {', '.join(sorted(part.needs))}]" if part.needs else ""
        lines.append(f"      {name}{needs}: {part.summary}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted; "[]" marks the items of a list, "<name>" the values of a mapping
    type: str
    default: Any
    description: str | None
    section: bool  # a group of keys rather than a value


def _deref(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[1]]
        return {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def _type(node: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in node:
        return node["$ref"].rsplit("/", 1)[1]
    if "enum" in node:
        return " | ".join(json.dumps(v) for v in node["enum"])
    if "const" in node:
        return json.dumps(node["const"])
    if "anyOf" in node:
        return " | ".join(_type(option, defs) for option in node["anyOf"])
    kind = node.get("type", "any")
    if kind == "array":
        return f"list[{_type(node.get('items', {}), defs)}]"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"dict[str, {_type(node['additionalProperties'], defs)}]"
    return {"number": "float", "integer": "int", "boolean": "bool", "string": "str"}.get(kind, kind)


def _children(node: dict[str, Any], defs: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The keys below a field: a section's own fields, or those of its list items / mapping
    values / non-null option."""
    node = _deref(node, defs)
    if "properties" in node:
        return [(name, sub) for name, sub in node["properties"].items()]
    for option in node.get("anyOf", ()):
        if option.get("type") != "null":
            found = _children(option, defs)
            if found:
                return found
    if node.get("type") == "array":
        return [(f"[].{name}", sub) for name, sub in _children(node.get("items", {}), defs)]
    if isinstance(node.get("additionalProperties"), dict):
        return [(f"<name>.{name}", sub) for name, sub in _children(node["additionalProperties"], defs)]
    return []


def key_docs(schema: type[pydantic.BaseModel]) -> list[KeyDoc]:
    """Every key of `schema`, depth first, in declaration order."""
    root = schema.model_json_schema()
    defs = root.get("$defs", {})
    out: list[KeyDoc] = []

    def walk(prefix: str, node: dict[str, Any]) -> None:
        for name, sub in _children(node, defs):
            key = f"{prefix}{name}".replace(".[]", "[]")
            children = _children(sub, defs)
            description = sub.get("description") or _deref(sub, defs).get("description")
            registry = _registry(key)
            kind = _type(sub, defs) if registry is None else \
                " | ".join([*(json.dumps(n) for n in registry.names()), "module:function"])
            out.append(KeyDoc(key, kind, sub.get("default"), description, bool(children)))
            if children:
                walk(f"{key}.", sub)

    walk("", root)
    return out


def _default(value: Any) -> str:
    if isinstance(value, (dict, list)) and len(json.dumps(value)) > 60:
        return "(see its keys)" if isinstance(value, dict) else f"{len(value)} entries"
    return json.dumps(value)


def explain(schema: type[pydantic.BaseModel], key: str) -> str:
    """A key's type, default and description (a section: each key under it)."""
    docs = key_docs(schema)
    wanted = key.strip(".")
    hits = [d for d in docs if d.key == wanted or d.key.startswith(wanted + ".") or d.key.startswith(wanted + "[]")]
    if not hits:
        near = difflib.get_close_matches(wanted, [d.key for d in docs], n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ConfigError(f"{wanted}: no such key in the {schema.__name__} config{hint}")
    lines = []
    for d in hits:
        if d.section:
            lines.append(f"{d.key}  [section {d.type}]\n    {d.description or ''}")
        else:
            lines.append(f"{d.key}: {d.type} = {_default(d.default)}\n    {d.description or ''}")
            registry = _registry(d.key)
            if registry is not None and len(hits) == 1:
                lines.append(f"    registered ({registry.kind}s):\n{registered_parts(registry)}")
    return "\n".join(lines)


def reference_markdown(schemas: dict[str, type[pydantic.BaseModel]]) -> str:
    """docs/config.md: one table per command's config."""
    parts = ["# Config reference\n",
             "Every key of every command's config: its type, its default and what it does. Generated from the",
             "schema by `python -m opd_jax.config.reference > docs/config.md` (a test checks it is current);",
             "`opd-jax config explain KEY` prints one key, `opd-jax config show CONFIG` a resolved config.\n"]
    for command, schema in schemas.items():
        parts.append(f"## `opd-jax {command}` ({schema.__name__})\n")
        parts.append("| key | type | default | what it does |")
        parts.append("| --- | --- | --- | --- |")
        for d in key_docs(schema):
            default = "" if d.section else f"`{_default(d.default)}`"
            kind = (f"section `{d.type}`" if d.section else f"`{d.type}`").replace("|", "\\|")
            text = (d.description or "").replace("|", "\\|").replace("\n", " ")
            parts.append(f"| `{d.key}` | {kind} | {default} | {text} |")
        parts.append("")
    return "\n".join(parts + held_out_markdown())


def held_out_markdown() -> list[str]:
    """The held-out split's rule and each built-in domain's and environment's problem space."""
    from opd_jax.data import DOMAINS
    from opd_jax.data.splits import ENUMERABLE
    from opd_jax.envs.protocol import builtin_environments

    lines = ["## Held-out problems\n",
             "A problem is a built-in domain's prompt text, or an environment episode's content (its secret, map",
             "or problem text: the environment's `problem_key()`; a plugin environment without one: its episode",
             "seed). It is held out when `blake2b(data.seed, problem) / 2^64 < data.held_out_share` (default",
             f"0.25); in a problem space of at most {ENUMERABLE:,} problems, exactly round(share × size) problems,",
             "those of lowest hash, are held out. Training, the warm start, validation draws and the teachers'",
             "samples draw only the rest; the held-out evaluation takes the first `data.eval_prompts_per_domain`",
             "(or the source's `eval_prompts`) distinct held-out problems. Another `data.seed` holds out another",
             "set; an expert's and its merge's must agree (the merge checks). Asking for more held-out problems",
             "than the share holds is one error naming the source and its size. JSONL sources hold out their",
             "`eval_jsonl` file; a prompt in both files is warned of.\n",
             "| source | problem space | at default parameters |",
             "| --- | --- | ---: |"]
    for name, domain in DOMAINS.items():
        lines.append(f"| `{name}` | {domain.space_rule} | {domain.sampler().space:,} |")
    for name, env in sorted(builtin_environments().items()):
        rule = (env.problem_space.__doc__ or "").strip().split("\n")[0]
        lines.append(f"| environment `{name}` | {rule} | {env.problem_space():,} |")
    return lines + [""]


if __name__ == "__main__":
    from opd_jax.config.commands import command_schemas

    print(reference_markdown(command_schemas()), end="")
