"""The request bodies the bridge sends are ones SGLang's own request types accept. The `sglang`
package cannot be imported on this CPU machine (its io_struct pulls in triton, torchvision and
tvm_ffi), so its wheel is downloaded without dependencies and the request classes are read from
its source: every key we send must be a field of SGLang's type, with a matching annotation."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile

import pytest

from rollout_bridge import sglang_api as api
from rollout_bridge.records import Request, SamplingParams

SGLANG = "sglang==0.5.23"


@pytest.fixture(scope="module")
def sglang_source(tmp_path_factory):
    target = tmp_path_factory.mktemp("sglang_wheel")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(target), SGLANG],
                   check=True)
    (wheel,) = target.glob("sglang-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return {name: z.read(f"sglang/srt/{name}").decode()
                for name in ("managers/io_struct.py", "sampling/sampling_params.py")}


def fields(source: str, name: str) -> dict[str, str]:
    """Annotated fields of class `name` and of its bases defined in the same file."""
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
    out: dict[str, str] = {}
    for base in classes[name].bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out.update(fields(source, base.id))
    out.update({s.target.id: ast.unparse(s.annotation) for s in classes[name].body if isinstance(s, ast.AnnAssign)})
    return out


REQUEST = Request((1, 2, 3), SamplingParams(max_new_tokens=5, temperature=0.7, top_k=0, stop_token_ids=(2,)), seed=4)


def test_generate_body_fits_generate_req_input(sglang_source):
    io = sglang_source["managers/io_struct.py"]
    for body in (api.generate_body(REQUEST, "r-0", stream=True, prefix=(7,)), api.score_body([1, 2, 3], "s")):
        accepted = fields(io, "GenerateReqInput")
        assert set(body) <= set(accepted), set(body) - set(accepted)
        sampling = fields(sglang_source["sampling/sampling_params.py"], "SamplingParams")
        assert set(body["sampling_params"]) <= set(sampling), set(body["sampling_params"]) - set(sampling)
    assert "int" in accepted["logprob_start_len"] and "bool" in accepted["stream"]


def test_refit_and_abort_bodies_fit_sglangs_types(sglang_source):
    io = sglang_source["managers/io_struct.py"]
    update = fields(io, "UpdateWeightFromDiskReqInput")
    body = api.update_weights_body("/ckpt/v3", 3)
    assert set(body) <= set(update) and "str" in update["weight_version"] and isinstance(body["weight_version"], str)
    abort = fields(io, "AbortReq")
    for body in (api.abort_body("r-1"), api.abort_body(None)):
        assert set(body) <= set(abort)
