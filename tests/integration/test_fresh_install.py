"""A fresh machine's install, both ways, beside packages that own the product folders' names.

transformers 5.25 pulls Hugging Face's `kernels`, a top-level package that used to win over this
checkout's kernels/ (genpool worker: "cannot import name 'DecodeStack' from 'kernels'"). Here a
throwaway venv gets the locked releases (that transformers and its `kernels` included) plus
decoy top-level `engine`, `schemas`, `workers` and `producer` packages that raise on import; then
genpool, editable and then regular (a wheel carrying the C sources, which the worker compiles on
first use into a fresh GENPOOL_HOME). From a directory outside the checkout: `genpool --help`,
every genpool module imports, and a worker on the shipped GGUF file runs a chat job to the end.
"""
from __future__ import annotations

import pytest

from tests.fresh_install import IMPORTS, LOCK, ROOT, Venv, install, name_suspects, run_job, wheel_files


@pytest.fixture(scope="module")
def gguf_file(smollm2_path):
    from genpool.engine.models.registry import gguf_path
    return gguf_path("smollm2-135m")


def _checks(venv: Venv, outside, url, gguf, home) -> dict:
    assert "genpool: Redis-streams LLM worker pool" in venv.run(venv.bin("genpool"), "--help", cwd=outside)
    assert "imports ok" in venv.run_py(IMPORTS, "triton", "fastapi", "uvicorn", "httpx",
                                       cwd=outside)  # [worker] only: the gateway extra is absent
    for name in ("engine", "schemas", "workers", "producer"):  # the decoys still own their names
        out = venv.run_py(f"try:\n import {name}\nexcept ImportError as e:\n print(e)", cwd=outside)
        assert "decoy" in out, out
    got = run_job(venv, url, str(gguf), outside, home)
    assert got["ok"] and got["tokens"] > 0 and got["finish"] in ("stop", "length"), got
    return got


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.checkpoint
def test_editable_and_regular_installs_run_a_job_from_outside(tmp_path, redis_url, gguf_file):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    venv = Venv(tmp_path / "venv")
    install(venv, editable=True)
    venv.add_decoys()
    editable = _checks(venv, outside, redis_url, gguf_file, tmp_path / "home-editable")

    venv.run(venv.python, "-m", "pip", "uninstall", "-y", "-q", "genpool")
    install(venv, editable=False)
    assert venv.decoys_intact()  # the wheel wrote into no other package's directory
    files = wheel_files(venv)
    tops = {f.split("/")[0] for f in files}
    assert tops <= {"genpool", "genpool-0.1.0.dist-info", ".."}, tops  # "..": bin/genpool
    assert {"genpool/kernels/cpu/cpu_gemm.c", "genpool/kernels/cpu/cpu_qgemm_vnni.c",
            "genpool/kernels/cpu/cpu_kernels.h", "genpool/schemas/scripts.py"} <= set(files)
    assert not any(f.startswith("genpool/tests") for f in files)
    home = tmp_path / "home-regular"  # no C kernels built yet: the worker compiles the wheel's sources
    regular = _checks(venv, outside, redis_url, gguf_file, home)
    assert list((home / "kernels").glob("cpu_decode_layers-*.so"))
    assert regular["text"] == editable["text"]  # greedy: the same answer from either install


def test_a_breaking_release_is_named_by_package_and_version():
    """What .ci/latest-releases prints when today's releases break genpool."""
    err = ('Traceback (most recent call last):\n  File "/v/lib/python3.11/site-packages/genpool/engine/x.py"\n'
           '  File "/v/lib/python3.11/site-packages/transformers/activations.py", line 22\n'
           '  File "/v/lib/python3.11/site-packages/kernels/__init__.py", line 3\nImportError: boom')
    dists = {"transformers": ["transformers"], "kernels": ["kernels"], "genpool": ["genpool"]}
    versions = {"transformers": "5.26.0", "kernels": "0.20.0", "torch": "2.13.0+cpu", "redis": "8.1.0"}
    pins = {"transformers": "5.25.0", "kernels": "0.19.1", "torch": "2.13.0", "redis": "8.1.0"}
    got = name_suspects(err, dists, versions, pins)
    assert got[:2] == ["in the traceback: kernels 0.20.0 (locked: 0.19.1)",
                       "in the traceback: transformers 5.26.0 (locked: 5.25.0)"]
    assert "differs from the lock: transformers 5.26.0 (locked 5.25.0)" in got
    assert not any("torch" in line or "redis" in line or "genpool" in line for line in got)
    assert "genpool itself" in name_suspects("ValueError: x", dists, pins, pins)[0]


@pytest.mark.slow
@pytest.mark.redis
def test_producers_need_only_redis_and_pydantic(tmp_path, redis_url):
    """`pip install .` without extras: Client, the schemas and the producer commands work."""
    venv = Venv(tmp_path / "venv")
    venv.pip("-c", LOCK, ROOT)
    extra = set(venv.versions()) - {"genpool", "redis", "pydantic", "pydantic-core", "annotated-types",
                                    "typing-extensions", "typing-inspection", "pip", "setuptools"}
    assert not extra, extra
    out = venv.run_py("import sys, genpool.producer, genpool.schemas, genpool.producer.cli, genpool.producer.aio; "
                      "print(sorted(m.split('.')[0] for m in sys.modules if m.split('.')[0] in "
                      "('torch', 'numpy', 'transformers')))", cwd=tmp_path)
    assert out.strip() == "[]"
    assert "submit" in venv.run(venv.bin("genpool"), "--help", cwd=tmp_path)
    status = venv.run(venv.bin("genpool"), "status", "--redis", redis_url, "--prefix", "test-fresh-none",
                      cwd=tmp_path)
    assert "workers: 0 alive" in status, status
