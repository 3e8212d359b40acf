"""A fresh install of this checkout in a throwaway venv, used from outside the checkout.

Shared by tests/integration/test_fresh_install.py (through the lock, with decoy top-level
packages, editable and regular installs) and .ci/latest-releases (the current releases, no lock:
`python -P tests/fresh_install.py --latest`). Standard library only: it drives other interpreters.
On a failure it names the packages that likely broke it: the third-party package in the failing
traceback, and every installed version that differs from the lock.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / ".ci" / "constraints.txt"
DROP = """
import sys
from genpool.schemas.connection import connect, delete_prefix
delete_prefix(connect(sys.argv[1]), sys.argv[2])
"""
DECOYS = ("engine", "schemas", "workers", "producer")  # `kernels` is Hugging Face's, pulled by transformers
JOB = """
import json, sys
from genpool.producer import Client
c = Client(sys.argv[1], prefix=sys.argv[2], job_ttl_s=120)
r = c.submit(messages=[{"role": "user", "content": "What is the capital of France?"}], model=sys.argv[3],
             max_tokens=16, temperature=0).result(timeout=float(sys.argv[4]))
print(json.dumps({"ok": r.ok, "text": r.text, "finish": r.finish_reason, "tokens": r.usage.completion_tokens}))
"""
IMPORTS = """
import importlib, pkgutil, sys, kernels, genpool.kernels
from genpool.kernels import DecodeStack  # the name the broken install could not find
assert hasattr(kernels, "get_kernel"), kernels.__file__   # top-level `kernels` stays Hugging Face's
optional = set(sys.argv[1:])  # extras not installed: their modules may miss these
names, bad = [], []
for top in ("engine", "kernels", "workers", "producer", "schemas"):
    pkg = importlib.import_module("genpool." + top)
    names += [pkg.__name__] + [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name.split(".")[0] not in optional:
            bad.append(f"{name}: {e}")
    except Exception as e:
        bad.append(f"{name}: {type(e).__name__}: {e}")
assert len(names) > 100 and not bad, (len(names), bad)
print(f"imports ok: {len(names)} modules")
"""


class Failed(RuntimeError):
    pass


class Venv:
    def __init__(self, where: Path, log=print):
        self.dir, self.log = where, log
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
        self.python = where / "bin" / "python"
        self.site = Path(self.run_py("import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())

    def run(self, *cmd, cwd=None, timeout=900, env=None) -> str:
        t0 = time.monotonic()
        env = dict(env or os.environ)
        env.pop("PYTHONPATH", None)  # a fresh interpreter: nothing of the checkout's on its path
        p = subprocess.run([str(c) for c in cmd], cwd=cwd or self.dir, capture_output=True, text=True,
                           timeout=timeout, env=env)
        self.log(f"  {' '.join(map(str, cmd))[:140]}  ({time.monotonic() - t0:.0f} s, rc {p.returncode})")
        if p.returncode != 0:
            raise Failed(f"{' '.join(map(str, cmd))} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
        return p.stdout

    def run_py(self, code: str, *args, **kw) -> str:
        return self.run(self.python, "-P", "-c", code, *args, **kw)

    def pip(self, *args, **kw) -> str:
        return self.run(self.python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args, **kw)

    def bin(self, name: str) -> Path:
        return self.dir / "bin" / name

    def versions(self) -> dict[str, str]:
        out = self.run(self.python, "-m", "pip", "list", "--format=json", "--disable-pip-version-check")
        return {norm(d["name"]): d["version"] for d in json.loads(out)}

    def add_decoys(self) -> None:
        """Top-level packages with the product folders' names, each raising on import, as another
        distribution could ship them (written straight into site-packages)."""
        for name in DECOYS:
            (self.site / name).mkdir(exist_ok=True)
            (self.site / name / "__init__.py").write_text(
                f'raise ImportError("decoy top-level {name!r}: genpool must import genpool.{name}")\n')

    def decoys_intact(self) -> bool:
        return all("decoy" in (self.site / n / "__init__.py").read_text() for n in DECOYS)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", line)
        if m:
            pins[norm(m.group(1))] = m.group(2)
    return pins


def held() -> list[str]:
    """The lock's held-back releases, each with its reason (.ci/held.txt)."""
    lines = (ROOT / ".ci" / "held.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def install(venv: Venv, editable: bool, extras: str = "worker", lock: bool = True) -> None:
    venv.pip("torch==2.13.0")  # first and pinned: an unpinned torch pulls a multi-GB CUDA build
    spec = f"{ROOT}[{extras}]"
    venv.pip(*(["-c", LOCK] if lock else []), *(["-e", spec] if editable else [spec]))


def wheel_files(venv: Venv) -> list[str]:
    """What the installed genpool distribution put into the venv (its RECORD)."""
    out = venv.run_py("import importlib.metadata as m; print('\\n'.join(str(f) for f in m.files('genpool')))")
    return sorted(out.split())


def run_job(venv: Venv, url: str, model: str, outside: Path, home: Path, timeout: float = 600) -> dict:
    """`genpool worker` started from outside the checkout, one chat job through it."""
    # under the suite's run id when there is one (tests/hygiene.py then checks its keys too)
    run = os.environ.get("GENPOOL_TEST_SESSION", "latest")
    prefix = f"test-{run}-fresh-{os.getpid()}-{time.time_ns() % 10**6}"
    env = dict(os.environ, GENPOOL_HOME=str(home))
    env.pop("PYTHONPATH", None)
    log = outside / f"{prefix}.log"
    with open(log, "wb") as err:
        worker = subprocess.Popen([str(venv.bin("genpool")), "worker", "--model", model, "--redis", url,
                                   "--prefix", prefix, "--name", prefix, "--num-kv-blocks", "256"],
                                  cwd=outside, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        out = venv.run_py(JOB, url, prefix, Path(model).name, str(timeout), cwd=outside, env=env,
                          timeout=timeout + 60)
    except Failed as e:
        raise Failed(f"{e}\nworker log:\n{log.read_text()[-6000:]}") from None
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        venv.run_py(DROP, url, prefix, cwd=outside, env=env)  # its lane streams have no TTL
    return json.loads(out.strip().splitlines()[-1])


def suspects(venv: Venv, error: str) -> list[str]:
    """Which packages broke it, asked of the venv that failed."""
    dists = json.loads(venv.run_py("import importlib.metadata as m, json; print(json.dumps(m.packages_distributions()))"))
    return name_suspects(error, dists, venv.versions(), locked())


def name_suspects(error: str, dists: dict[str, list[str]], versions: dict[str, str],
                  pins: dict[str, str]) -> list[str]:
    """The third-party distributions in the failing traceback (innermost first), then every
    installed version that differs from the lock; or a line saying there is neither."""
    names = []
    for top in re.findall(r"site-packages/([A-Za-z0-9_]+)", error)[::-1]:
        for d in dists.get(top, []):
            if norm(d) != "genpool" and norm(d) not in names:
                names.append(norm(d))
    lines = [f"in the traceback: {n} {versions.get(n, '?')} (locked: {pins.get(n, 'not locked')})" for n in names[:3]]
    lines += [f"differs from the lock: {n} {v} (locked {pins[n]})" for n, v in sorted(versions.items())
              if n in pins and pins[n].split("+")[0] != v.split("+")[0]]
    return lines or ["no third-party package in the traceback and every version is the lock's: "
                     "the cause is genpool itself or this machine"]


def latest(url: str, keep: bool = False) -> int:
    """The current releases, no lock: a regular install, a worker's job, imports, `genpool --help`."""
    tmp = Path(tempfile.mkdtemp(prefix="genpool-latest-"))
    venv = None
    try:
        t0 = time.monotonic()
        venv = Venv(tmp / "venv")
        install(venv, editable=False, extras="worker,convert,gateway", lock=False)
        print(f"installed the latest releases in {time.monotonic() - t0:.0f} s")
        venv.run(venv.bin("genpool"), "--help", cwd=tmp)
        venv.run_py(IMPORTS, "triton", cwd=tmp)
        venv.run(venv.bin("genpool"), "models", "pull", "smollm2-135m", cwd=tmp,
                 env=dict(os.environ, GENPOOL_HOME=str(tmp / "home")))
        got = run_job(venv, url, "smollm2-135m", tmp, tmp / "home")
        if not (got["ok"] and got["tokens"] > 0):
            raise Failed(f"the job did not finish: {got}")
        print(f"latest releases: ok in {time.monotonic() - t0:.0f} s; answer {got['text']!r}")
        pins = locked()
        newer = [f"{n} {v} (locked {pins[n]})" for n, v in sorted(venv.versions().items())
                 if n in pins and pins[n].split("+")[0] != v.split("+")[0]]
        print("newer than the lock, and working here:", ", ".join(newer) or "none")
        print("held back on purpose (.ci/held.txt):", ", ".join(held()) or "none")
        return 0
    except (Failed, subprocess.TimeoutExpired) as e:
        print(f"LATEST RELEASES CHECK FAILED:\n{e}", file=sys.stderr)
        if venv is not None:
            for line in suspects(venv, str(e)):
                print(f"  suspect: {line}", file=sys.stderr)
        return 1
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latest", action="store_true", help="install the current releases (no lock) and check")
    ap.add_argument("--redis", default=os.environ.get("GENPOOL_TEST_REDIS_URL", "redis://127.0.0.1:6379/13"))
    ap.add_argument("--keep", action="store_true", help="keep the throwaway venv")
    a = ap.parse_args()
    sys.exit(latest(a.redis, a.keep) if a.latest else ap.error("say --latest"))
