"""Manifests checked against the schemas of their kinds, as the API server with strict field
validation (`kubectl apply --validate=strict`) would: core kinds with the `kubernetes-validate`
package's schemas, the JobSet and LeaderWorkerSet CRDs with their published OpenAPI schemas
(schemas/, copied unchanged from the CRDs; SOURCES.md names the commits) through jsonschema.

A CRD schema leaves `additionalProperties` open; the API server still rejects (strict) or prunes
unknown fields, so an object schema with `properties` is closed here unless the CRD says
`x-kubernetes-preserve-unknown-fields`: a misspelt field is an error, as on the cluster."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from opd_jax.k8s.spec import K8sError

SCHEMAS = Path(__file__).with_name("schemas")
# apiVersion → kind → schema file; every other apiVersion is a core kind
CRDS = {"jobset.x-k8s.io/v1alpha2": {"JobSet": "jobset.x-k8s.io_JobSet.v1alpha2.json"},
        "leaderworkerset.x-k8s.io/v1": {"LeaderWorkerSet": "leaderworkerset.x-k8s.io_LeaderWorkerSet.v1.json"}}


def _closed(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


@functools.cache
def _crd_validator(api_version: str, kind: str) -> Any:
    import jsonschema
    schema = _closed(json.loads((SCHEMAS / CRDS[api_version][kind]).read_text()))
    # metadata is the API server's ObjectMeta, which the CRD leaves as `type: object`
    schema.setdefault("properties", {})["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def _where(path: Iterable[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top)"


def _message(error: Any) -> str:
    if error.validator == "additionalProperties" and error.validator_value is False:
        unknown = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        return f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
    return error.message


def validate_manifest(doc: dict[str, Any], k8s_version: str | None = None) -> list[str]:
    """What is wrong with one manifest (empty: it validates), each as `Kind/name: where: what`."""
    api_version, kind = doc.get("apiVersion", ""), doc.get("kind", "")
    name = f"{kind}/{doc.get('metadata', {}).get('name', '?')}"
    if kind in CRDS.get(api_version, {}):
        errors = sorted(_crd_validator(api_version, kind).iter_errors(doc), key=lambda e: list(e.absolute_path))
        return [f"{name}: {_where(e.absolute_path)}: {_message(e)}" for e in errors]
    if api_version.split("/")[0].endswith(".x-k8s.io"):
        raise K8sError(f"{name}: no schema for {api_version} {kind} (known: "
                       f"{', '.join(f'{v} {k}' for v, kinds in CRDS.items() for k in kinds)})")
    try:
        import kubernetes_validate
    except ImportError:
        raise K8sError("checking manifests needs the kubernetes-validate package: pip install 'opd_jax[k8s]'") from None
    version = k8s_version or kubernetes_validate.latest_version()
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:  # the first error jsonschema found
        return [f"{name}: {_where(e.absolute_path)}: {_message(e)}"]
    except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as e:
        raise K8sError(f"{name}: kubernetes-validate has no schema for it at Kubernetes {version}: {e}") from None
    return []


def validate_manifests(docs: Iterable[dict[str, Any]], k8s_version: str | None = None) -> list[str]:
    return [problem for doc in docs for problem in validate_manifest(doc, k8s_version)]
