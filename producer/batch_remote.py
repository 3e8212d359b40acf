"""`genpool batch --remote URL`: a batch file run by a gateway's Batch API (server-side), followed
here with a progress bar. The machine running this may go away: the batch goes on in the pool.

The batch's id is kept beside the output (`<output>.batch`), so rerunning the same command
follows the batch it started instead of submitting the file again; the file goes once the
results are written.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

from .progress import make_progress

POLL_S = 0.5
DONE = ("completed", "failed", "expired", "cancelled")


class RemoteError(Exception):
    """The gateway refused a request (its OpenAI-shaped message)."""


class Remote:
    def __init__(self, base: str, api_key: Optional[str], timeout_s: float = 60.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base.rstrip("/") + "/v1", headers=headers,
                                 timeout=timeout_s)

    def call(self, method: str, path: str, **kw) -> httpx.Response:
        r = self.http.request(method, path, **kw)
        if r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text[:500]
            raise RemoteError(f"{method} {path}: {r.status_code}: {msg}")
        return r

    def submit(self, path: Path, endpoint: str) -> str:
        with open(path, "rb") as f:
            fid = self.call("POST", "/files", files={"file": (path.name, f)},
                            data={"purpose": "batch"}).json()["id"]
        return self.call("POST", "/batches", json={
            "input_file_id": fid, "endpoint": endpoint, "completion_window": "24h",
            "metadata": {"source": "genpool batch --remote"}}).json()["id"]

    def batch(self, batch_id: str) -> dict:
        return self.call("GET", f"/batches/{batch_id}").json()

    def content(self, file_id: Optional[str]) -> bytes:
        return self.call("GET", f"/files/{file_id}/content").content if file_id else b""


def endpoint_of(path: Path) -> str:
    """The url of the file's first line (a batch has one endpoint; the gateway checks the rest)."""
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    return json.loads(raw)["url"]
                except (ValueError, KeyError, TypeError):
                    break
    raise RemoteError(f"{path}: its first line is no batch request (custom_id, method, url, "
                      f"body)")


def follow(remote: Remote, batch_id: str, progress: bool) -> dict:
    """Poll the batch until it ends, with a progress bar of its answered lines."""
    b = remote.batch(batch_id)
    bar = make_progress(b["request_counts"]["total"], 0, progress)
    shown = 0
    try:
        while True:
            c = b["request_counts"]
            bar.set_postfix(status=b["status"], ok=c["completed"], err=c["failed"],
                            refresh=False)
            bar.update(c["completed"] + c["failed"] - shown)
            shown = c["completed"] + c["failed"]
            if b["status"] in DONE:
                return b
            time.sleep(POLL_S)
            b = remote.batch(batch_id)
    finally:
        bar.close()


def run_remote(base: str, api_key: Optional[str], input_path: Path, output: Path,
               errors_out: Optional[Path], progress: bool = True) -> int:
    """Exit status: 0 when every line completed, 1 when any failed or the batch did not
    complete, 2 when the gateway refused the batch."""
    state = output.with_name(output.name + ".batch")
    remote = Remote(base, api_key)
    try:
        if state.is_file():
            batch_id = json.loads(state.read_text())["batch_id"]
            print(f"genpool batch: following {batch_id} (from {state})", file=sys.stderr)
        else:
            batch_id = remote.submit(input_path, endpoint_of(input_path))
            state.write_text(json.dumps({"batch_id": batch_id, "gateway": base}) + "\n")
            print(f"genpool batch: submitted {batch_id}", file=sys.stderr)
        b = follow(remote, batch_id, progress)
        out, err = remote.content(b["output_file_id"]), remote.content(b["error_file_id"])
    except (RemoteError, httpx.HTTPError) as e:
        print(f"genpool batch: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ngenpool batch: interrupted; the batch goes on in the pool: rerun the same "
              "command to follow it", file=sys.stderr)
        return 130
    finally:
        remote.http.close()
    output.write_bytes(out if errors_out else out + err)
    if errors_out:
        errors_out.write_bytes(err)
    state.unlink()
    c = b["request_counts"]
    print(f"genpool batch: {b['status']}: {c['completed']} completed, {c['failed']} errors",
          file=sys.stderr)
    return 0 if b["status"] == "completed" and c["failed"] == 0 else 1
