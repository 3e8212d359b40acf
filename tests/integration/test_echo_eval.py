"""Prompt log-likelihoods through the gateway, as evaluation harnesses use them: `echo=True,
logprobs=k, max_tokens=0` through the official openai client, and lm-eval-harness's own
`local-completions` model on a log-likelihood task defined here (local JSONL, no hub), against HF
transformers on the same SmolLM2 checkpoint (fp32 worker): per token within 1e-3, the harness's
per-example log-likelihoods within 1e-3 and the same accuracy as its `hf` model."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
import torch

from genpool.producer import Client
from tests.pool_helpers import (
    ROOT,
    drop_prefix,
    free_port,
    http_ok,
    new_prefix,
    spawn_worker,
    stop_proc,
    wait_for,
    workers_alive,
)

pytestmark = [pytest.mark.slow, pytest.mark.checkpoint, pytest.mark.redis]
TEXT = "The capital of France is Paris. The capital of Italy is Rome."


@pytest.fixture(scope="module")
def pool(redis_url, smollm2_path, tmp_path_factory):
    prefix, port = new_prefix("echo"), free_port()
    logs = tmp_path_factory.mktemp("echo")
    worker = spawn_worker(redis_url, prefix, smollm2_path, "echo-w", "--served-model-name", "smol",
                          "--dtype", "float32", "--num-threads", "1",
                          log_path=logs / "worker.log")
    gw = subprocess.Popen([sys.executable, "-P", "-m", "genpool.workers.cli.main", "gateway",
                           "--port", str(port), "--redis", redis_url, "--prefix", prefix,
                           "--log-level", "warning"], cwd=ROOT,
                          stderr=open(logs / "gateway.log", "wb"))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_ok(f"{base}/health") or gw.poll() is not None, 60, what="gateway up")
        wait_for(lambda: workers_alive(redis_url, prefix) or worker.poll() is not None, 240,
                 what="worker up")
        assert worker.poll() is None, (logs / "worker.log").read_text()[-3000:]
        yield {"base": base, "prefix": prefix, "url": redis_url,
               "client": openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)}
    finally:
        stop_proc(gw, 10)
        stop_proc(worker)
        drop_prefix(redis_url, prefix)


@pytest.fixture(scope="module")
def hf(smollm2_path):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_path),
                                                              dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> list[float]:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        return [float(logp[i - 1, t]) for i, t in enumerate(ids) if i > 0]
    return tok, logprobs


def test_echo_scores_the_prompt_like_hf(pool, hf):
    tok, ref_logprobs = hf
    ids = tok(TEXT)["input_ids"]
    ref = ref_logprobs(ids)
    c = pool["client"]
    for prompt in (TEXT, ids):  # a string, and token ids
        out = c.completions.create(model="smol", prompt=prompt, echo=True, logprobs=1,
                                   max_tokens=0, temperature=0)
        ch = out.choices[0]
        lp = ch.logprobs
        assert ch.text == TEXT and ch.finish_reason == "length"
        assert lp.tokens == [tok.decode([t]) for t in ids] and "".join(lp.tokens) == TEXT
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(ref, abs=1e-3)
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
        assert all(len(t) == 1 for t in lp.top_logprobs[1:])
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0


def test_echo_of_token_ids_decodes_multibyte_characters_whole(pool, hf):
    """A token-id prompt's echo is the prompt decoded as a whole: an emoji or a CJK character
    split over byte-level tokens is one character, not each token's U+FFFD (the per-token texts
    the logprobs carry)."""
    tok, _ = hf
    text = "Café 😀 東京 ok"
    ids = tok(text)["input_ids"]
    assert "\ufffd" in "".join(tok.decode([t]) for t in ids)  # split characters, as the test needs
    c = pool["client"]
    for logprobs in (None, 1):
        kw = dict(model="smol", prompt=ids, echo=True, logprobs=logprobs, temperature=0)
        whole = c.completions.create(**kw, max_tokens=0).choices[0]
        assert whole.text == text
        chunks = [ch.choices[0] for ch in c.completions.create(**kw, max_tokens=2, stream=True)
                  if ch.choices]
        assert "".join(ch.text for ch in chunks).startswith(text)


def test_echo_with_generation_streamed_equals_whole(pool, hf):
    tok, _ = hf
    c = pool["client"]
    kw = dict(model="smol", prompt=TEXT, echo=True, logprobs=2, max_tokens=5, temperature=0)
    whole = c.completions.create(**kw).choices[0]
    n_prompt = len(tok(TEXT)["input_ids"])
    assert whole.text.startswith(TEXT) and len(whole.logprobs.tokens) == n_prompt + 5
    assert whole.logprobs.text_offset[n_prompt] == len(TEXT)
    chunks = [ch.choices[0] for ch in c.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(ch.text for ch in chunks) == whole.text
    streamed = [x for ch in chunks if ch.logprobs for x in ch.logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs
    offsets = [x for ch in chunks if ch.logprobs for x in ch.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset
    # echo without logprobs costs the job nothing: the prompt string is the gateway's own
    plain = c.completions.create(model="smol", prompt=TEXT, echo=True, max_tokens=3,
                                 temperature=0).choices[0]
    assert plain.text == whole.text[:len(plain.text)] and plain.logprobs is None


def test_prompt_logprobs_through_the_python_client(pool, hf):
    tok, ref_logprobs = hf
    ids = tok(TEXT)["input_ids"]
    with Client(pool["url"], prefix=pool["prefix"]) as client:
        res = client.submit(prompt=TEXT, prompt_logprobs=0, max_tokens=0).result(timeout=120)
    assert res.ok and res.token_ids == [] and res.prompt.token_ids == ids
    got = [d[str(t)] for d, t in zip(res.prompt.logprobs[1:], ids[1:])]
    assert res.prompt.logprobs[0] is None and got == pytest.approx(ref_logprobs(ids), abs=1e-3)


def test_vllm_prompt_logprobs_without_echo_come_back(pool, hf):
    """vLLM's `prompt_logprobs` extension (no echo): the job scores the prompt and each choice
    carries the scores in vLLM's shape (null first, then {id: {logprob, decoded_token}})."""
    tok, ref_logprobs = hf
    ids = tok(TEXT)["input_ids"]
    r = httpx.post(f"{pool['base']}/v1/completions", timeout=120, json={
        "model": "smol", "prompt": TEXT, "prompt_logprobs": 2, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert not ch["text"].startswith(TEXT)  # no echo
    got = ch["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    assert all(2 <= len(d) <= 3 for d in got[1:])
    assert [d[str(t)]["logprob"] for d, t in zip(got[1:], ids[1:])] == pytest.approx(
        ref_logprobs(ids), abs=1e-3)
    assert [d[str(t)]["decoded_token"] for d, t in zip(got[1:], ids[1:])] == [
        tok.decode([t]) for t in ids[1:]]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": ["a", "b"], "echo": True}, "prompt"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": [[1, 2], [3]], "echo": True}, "prompt"),
    ({"prompt": "x", "echo": True, "logprobs": 10**6}, "logprobs"),
])
def test_bad_echo_requests_are_400s(pool, body, param):
    r = httpx.post(f"{pool['base']}/v1/completions", json={"model": "smol", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_out_of_vocabulary_prompt_ids_fail_the_job_alone(pool):
    r = httpx.post(f"{pool['base']}/v1/completions", timeout=60, json={
        "model": "smol", "prompt": [1, 2, 10**9], "echo": True, "logprobs": 0, "max_tokens": 0})
    assert r.status_code == 400 and "prompt token ids" in r.json()["error"]["message"], r.text
    ok = pool["client"].completions.create(model="smol", prompt="Hi", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")  # the worker is unharmed


CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"),
            ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Kenya", "Nairobi")]
TASK = """task: genpool_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def _write_task(tmp_path) -> str:
    cities = [c for _, c in CAPITALS]
    with open(tmp_path / "capitals.jsonl", "w") as f:
        for i, (country, city) in enumerate(CAPITALS):
            choices = [city] + [cities[(i + k) % len(cities)] for k in (1, 3, 5)]
            f.write(json.dumps({"country": country, "choices": choices, "answer": 0}) + "\n")
    (tmp_path / "capitals.yaml").write_text(TASK.format(data=tmp_path / "capitals.jsonl"))
    return str(tmp_path)


def _harness(model: str, model_args: dict, include: str) -> tuple[float, list[list[float]]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["genpool_capitals"],
                                  task_manager=TaskManager(include_path=include), batch_size=1,
                                  log_samples=True, random_seed=0, numpy_random_seed=0,
                                  torch_random_seed=0, fewshot_random_seed=0)
    samples = sorted(out["samples"]["genpool_capitals"], key=lambda s: s["doc_id"])
    return (out["results"]["genpool_capitals"]["acc,none"],
            [[float(r[0][0]) for r in s["resps"]] for s in samples])


def test_lm_eval_harness_local_completions_equals_hf(pool, smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    include = _write_task(tmp_path)
    acc, lls = _harness("local-completions", {
        "base_url": f"{pool['base']}/v1/completions", "model": "smol",
        "tokenizer_backend": "huggingface", "tokenizer": str(smollm2_path),
        "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1}, include)
    hf_acc, hf_lls = _harness("hf", {"pretrained": str(smollm2_path), "dtype": "float32",
                                     "device": "cpu"}, include)
    assert len(lls) == len(hf_lls) == len(CAPITALS)
    for got, want in zip(lls, hf_lls):
        assert got == pytest.approx(want, abs=1e-3)
    assert acc == hf_acc and acc > 0.5  # the small model knows most capitals


TREE = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"name": {"type": "string"},
                                     "children": {"type": "array", "maxItems": 1,
                                                  "items": {"$ref": "#"}}},
    "required": ["name"], "additionalProperties": False}}}


def test_hostile_openai_inputs_get_clear_400s_and_leave_the_worker_unharmed(pool):
    """Huge tool lists, top_logprobs 10^6, out-of-vocabulary logit_bias: OpenAI-shaped 400s
    naming the parameter; a recursive tool schema is served (its call valid); then an ordinary
    request is answered as usual."""
    base, chat = pool["base"], [{"role": "user", "content": "Name a tree."}]
    weather = {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}
    bad = [({"messages": chat, "tools": [weather] * 10_000}, "/v1/chat/completions", "tools"),
           ({"messages": chat, "logprobs": True, "top_logprobs": 10**6}, "/v1/chat/completions",
            "top_logprobs"),
           ({"prompt": "Hi", "logit_bias": {"999999": 5}}, "/v1/completions", None)]
    for body, route, param in bad:
        r = httpx.post(base + route, json={"model": "smol", "max_tokens": 2, **body}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["message"] and (param is None or err["param"] == param), err
    answer = pool["client"].chat.completions.create(
        model="smol", messages=chat, tools=[TREE], tool_choice="required", max_tokens=200,
        temperature=0).choices[0]
    call = answer.message.tool_calls[0]  # greedy, the small model may nest until max_tokens
    assert call.function.name == "tree" and call.function.arguments.startswith("{")
    if answer.finish_reason == "tool_calls":
        import jsonschema
        jsonschema.validate(json.loads(call.function.arguments), TREE["function"]["parameters"])
    else:  # cut short: OpenAI's shape, the arguments so far and finish_reason "length"
        assert answer.finish_reason == "length"
    ok = pool["client"].completions.create(model="smol", prompt="Hi", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")
