"""workers/takeover.py: what a worker that takes a job over makes of the job's event log."""
from __future__ import annotations

from genpool.engine.identity import ModelIdentity
from genpool.schemas import RestartEvent, ResultEvent, ResumeEvent, TokenEvent
from genpool.workers.takeover import plan

ME = ModelIdentity("m", "rev1", "float32", None, "tok1")


def log(*events, first_seq: int = 1, ids_from: int = 1000):
    """An XRANGE reply (what redis-py returns) for these events, numbered as the worker does."""
    return [(f"{ids_from + k}-0", {b"event": ev.model_dump_json(exclude_none=True).encode(),
                                   b"seq": str(first_seq + k).encode()})
            for k, ev in enumerate(events)]


def tok(index, text, ids, first=False, identity=ME, seed=7, logprobs=None):
    extra = dict(model_identity=identity.to_dict(), seed=seed) if first else {}
    return TokenEvent(index=index, text=text, token_ids=ids, logprobs=logprobs, **extra)


def test_a_log_of_tokens_resumes_each_completion_after_its_own():
    t = plan(log(tok(0, "ab", [1, 2], first=True), tok(1, "c", [3]), tok(0, "d", [4])), 2, ME)
    assert not t.restart and t.resume.token_ids == [[1, 2, 4], [3]] and t.resume.seed == 7
    assert t.texts == {0: "abd", 1: "c"} and t.tokens == [3, 1]
    assert t.first_token_at == 1000.0 / 1000  # the first token entry's id, in seconds
    assert t.resume.logprobs == [[None, None, None], [None]]


def test_logprobs_come_back_aligned_with_their_tokens():
    first = tok(0, "ab", [1, 2], first=True, logprobs=[{"1": -0.5}, {"2": -1.0}])
    first.token_texts = {"1": "a", "2": "b"}
    t = plan(log(first), 1, ME)
    assert t.resume.logprobs == [[{1: -0.5}, {2: -1.0}]]
    # and as published, for the result the taker writes (with the tokens' texts)
    assert t.logprobs == {0: [{"1": -0.5}, {"2": -1.0}]} and t.token_texts == {"1": "a", "2": "b"}


def test_the_prompts_logprobs_published_with_the_first_token_come_back():
    """A job that asked for prompt_logprobs and finished before its result was written: the taker
    runs no prefill, so the result's PromptScores must come from the log."""
    from genpool.schemas.events import PromptScores
    from genpool.workers.job import Entry, Job

    scores = PromptScores(token_ids=[5, 6], logprobs=[None, {"6": -2.5}],
                          token_texts={"5": "x", "6": "y"})
    first = tok(0, "a", [1], first=True)
    first.prompt = scores
    t = plan(log(first, tok(0, "b", [2])), 1, ME)
    assert t.prompt == scores
    job = Job(Entry("stream", "lane", "1-0", {}))
    job.prime(t)
    assert job.prompt_scores == scores


def test_an_empty_log_is_a_plain_start():
    t = plan([], 1, ME)
    assert t.resume is None and not t.restart


def test_only_the_attempt_after_the_last_restart_counts():
    entries = log(tok(0, "xx", [9, 9], first=True), RestartEvent(reason="r", attempt=2),
                  tok(0, "a", [1], first=True, seed=11))
    t = plan(entries, 1, ME)
    assert t.resume.token_ids == [[1]] and t.resume.seed == 11


def test_a_resumed_attempts_tokens_add_to_the_earlier_ones():
    entries = log(tok(0, "a", [1], first=True), ResumeEvent(attempt=2, tokens=[1]),
                  tok(0, "b", [2]))
    t = plan(entries, 1, ME)
    assert t.resume.token_ids == [[1, 2]] and t.resume.seed == 7  # the first attempt's seed


def test_a_log_with_a_hole_restarts_and_says_why():
    entries = log(tok(0, "a", [1], first=True), tok(0, "b", [2]))
    entries[1][1][b"seq"] = b"3"  # entry 2 is gone
    t = plan(entries, 1, ME)
    assert t.resume is None and "incomplete" in t.restart and "entry 2" in t.restart


def test_a_trimmed_start_restarts():
    t = plan(log(tok(0, "b", [2]), first_seq=5), 1, ME)
    assert t.resume is None and "entry 1 is missing" in t.restart


def test_another_model_identity_restarts_and_names_the_difference():
    int8 = ModelIdentity("m", "rev1", "float32", "int8", "tok1")
    t = plan(log(tok(0, "a", [1], first=True, identity=int8)), 1, ME)
    assert t.resume is None and "quantization 'int8' != None" in t.restart


def test_a_first_token_without_an_identity_restarts():
    t = plan(log(TokenEvent(index=0, text="a", token_ids=[1])), 1, ME)
    assert t.resume is None and "no model identity" in t.restart


def test_completions_beyond_n_restart():
    t = plan(log(tok(0, "a", [1], first=True), tok(2, "b", [2])), 2, ME)
    assert t.resume is None and "beyond n=2" in t.restart


def test_a_log_that_already_ended_is_not_resumed():
    from genpool.schemas import Usage

    entries = log(tok(0, "a", [1], first=True),
                  ResultEvent(text="a", usage=Usage(), finish_reason="stop"))
    t = plan(entries, 1, ME)
    assert t.resume is None and "already ends" in t.restart


def test_quantized_products_computed_another_way_restart():
    """int8 on AMX tiles (bf16 activations) and on dot products (int8 activations) give different logits."""
    amx = ModelIdentity("m", "rev1", "float32", "int8", "tok1", products="amx")
    dots = ModelIdentity("m", "rev1", "float32", "int8", "tok1", products="vnni")
    t = plan(log(tok(0, "a", [1], first=True, identity=amx)), 1, dots)
    assert t.resume is None and "products 'amx' != 'vnni'" in t.restart
    assert amx.key != dots.key and ModelIdentity.from_dict(amx.to_dict()) == amx
    assert plan(log(tok(0, "a", [1], first=True, identity=amx)), 1, amx).resume is not None


def test_an_unreadable_entry_restarts_the_job_instead_of_failing_the_taker():
    """A peer's (or anyone's) entry in the log that does not parse (garbage, a missing event,
    a logprob written as null) makes the taker rerun the job, never raise out of admission."""
    good = log(tok(0, "ab", [1, 2], first=True))
    for bad in ({b"event": b"{not json", b"seq": b"2"}, {b"seq": b"2"},
                {b"event": b'{"type":"token","token_ids":[3],"logprobs":[{"3":null}]}', b"seq": b"2"}):
        t = plan(good + [("1001-0", bad)], 1, ME)
        assert t.resume is None and "unreadable" in t.restart, bad
