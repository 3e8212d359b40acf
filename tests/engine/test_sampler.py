import math

import pytest
import torch

from genpool.engine.sampler import (
    Sampler,
    SampleRow,
    apply_min_p,
    apply_presence_frequency,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    make_generator,
)
from genpool.engine.sampling_params import SamplingParams

INF = float("inf")


def row(prompt=(), output=(), seed=None, eos=(), **kw):
    params = SamplingParams(seed=seed, **kw)
    return SampleRow(params, list(prompt), list(output), seed, tuple(eos))


def logits_for(probs):
    return torch.tensor([math.log(p) for p in probs])


# ---- logits processors, checked against hand computed values ----------------------------------
def test_repetition_penalty_by_hand():
    x = torch.tensor([2.0, -1.0, 0.5, 3.0, -4.0])
    apply_repetition_penalty(x, [0, 1, 1, 4], 2.0)  # duplicates count once
    assert x.tolist() == [1.0, -2.0, 0.5, 3.0, -8.0]
    y = torch.tensor([2.0, -1.0])
    apply_repetition_penalty(y, [0, 1], 0.5)  # < 1 rewards repeats
    assert y.tolist() == [4.0, -0.5]


def test_presence_and_frequency_penalty_by_hand():
    x = torch.zeros(4)
    apply_presence_frequency(x, [1, 1, 2, 1], presence=0.5, frequency=0.25)
    assert x.tolist() == [0.0, -1.25, -0.75, 0.0]  # 1: 0.5 + 3*0.25; 2: 0.5 + 0.25
    z = torch.zeros(3)
    apply_presence_frequency(z, [0], presence=-1.0, frequency=0.0)
    assert z.tolist() == [1.0, 0.0, 0.0]


def test_top_k_top_p_min_p_masks():
    x = logits_for([0.5, 0.3, 0.15, 0.05])
    keep = lambda t: (t > -INF).nonzero().flatten().tolist()  # noqa: E731
    assert keep(apply_top_k(x, 2)) == [0, 1]
    assert keep(apply_top_k(x, -1)) == [0, 1, 2, 3]
    assert keep(apply_top_p(x, 0.75)) == [0, 1]
    assert keep(apply_top_p(x, 0.85)) == [0, 1, 2]
    assert keep(apply_top_p(x, 0.01)) == [0]
    assert keep(apply_top_p(x[[3, 1, 0, 2]], 0.75)) == [1, 2]  # order of the vocab is irrelevant
    assert keep(apply_min_p(x, 0.5)) == [0, 1]  # threshold 0.25
    assert keep(apply_min_p(x, 0.2)) == [0, 1, 2]  # threshold 0.1
    assert keep(apply_min_p(x, 1.0)) == [0]


# ---- the Sampler --------------------------------------------------------------------------------
def test_penalties_change_the_greedy_choice():
    x = torch.tensor([[2.0, 1.5, -1.0, 0.0]])
    s = Sampler()
    assert s(x, [row(temperature=0)])[0] == [0]
    # token 0 seen in the prompt: 2.0 / 2 = 1.0 < 1.5
    assert s(x, [row(prompt=[0], temperature=0, repetition_penalty=2.0)])[0] == [1]
    # presence penalty applies to OUTPUT tokens only
    assert s(x, [row(prompt=[0], temperature=0, presence_penalty=1.0)])[0] == [0]
    assert s(x, [row(output=[0], temperature=0, presence_penalty=1.0)])[0] == [1]
    # frequency: 2.0 - 3*0.2 = 1.4 < 1.5
    assert s(x, [row(output=[0, 0, 0], temperature=0, frequency_penalty=0.2)])[0] == [1]
    assert s(x, [row(output=[0, 0], temperature=0, frequency_penalty=0.2)])[0] == [0]


def test_logit_bias_moves_greedy_and_sampled_choices_but_not_logprobs():
    x = torch.tensor([[2.0, 1.5, -1.0, 0.0]] * 3)
    s = Sampler()
    rows = [row(temperature=0, logprobs=1), row(temperature=0, logit_bias={"0": -100}),
            row(temperature=0, logit_bias={3: 2.1})]  # 0.0 + 2.1 > 2.0
    tokens, lps = s(x, rows)
    assert tokens == [0, 1, 3]
    assert lps[0][0] == pytest.approx(float(torch.log_softmax(x[0], -1)[0]))  # raw logits
    # sampled: +100 on one token makes it all but certain; -100 on the rest of the mass too
    forced = [row(temperature=1.0, seed=k, logit_bias={2: 100}) for k in range(20)]
    assert s(torch.tensor([[2.0, 1.5, -1.0, 0.0]] * 20), forced)[0] == [2] * 20
    banned = [row(temperature=1.0, seed=k, logit_bias={0: -100, 1: -100}) for k in range(20)]
    assert set(s(torch.tensor([[2.0, 1.5, -1.0, 0.0]] * 20), banned)[0]) <= {2, 3}


def test_logit_bias_is_checked():
    for bad, msg in (({"a": 1}, "token ids"), ({1: 100.5}, r"\[-100, 100\]"),
                     ({i: 1 for i in range(1025)}, "at most 1024"), ([1], "an object")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(logit_bias=bad)
    assert SamplingParams(logit_bias={}).logit_bias is None
    p = SamplingParams(logit_bias={"7": 3})
    assert p.logit_bias == {7: 3.0} and SamplingParams.from_dict(p.to_dict()) == p


def test_greedy_batched_equals_per_row_and_ties_take_lowest_id():
    torch.manual_seed(0)
    x = torch.randn(6, 50)
    x[2, 7] = x[2, 30] = 100.0  # tie
    rows = [row(temperature=0) for _ in range(6)]
    toks, lps = Sampler()(x, rows)
    assert toks == x.argmax(dim=-1).tolist()
    assert toks[2] == 7 and lps == [None] * 6
    # a penalized (slow path) row with no effective penalty agrees with the fast path
    slow = [row(temperature=0, output=[49], presence_penalty=1e-9) for _ in range(6)]
    assert Sampler()(x, slow)[0] == toks


def test_input_logits_not_modified_and_any_float_dtype():
    x = torch.randn(2, 20, dtype=torch.bfloat16)
    before = x.clone()
    rows = [row(prompt=[1, 2], temperature=0, repetition_penalty=1.5),
            row(seed=3, top_k=5, output=[4], frequency_penalty=1.0)]
    toks, _ = Sampler()(x, rows)
    assert torch.equal(x, before) and all(isinstance(t, int) for t in toks)
    toks16, _ = Sampler()(x.half(), [row(temperature=0)] * 2)
    assert toks16 == x.float().argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_equal_greedy():
    torch.manual_seed(1)
    x = torch.randn(8, 100) * 3
    greedy = x.argmax(-1).tolist()
    for seed in range(5):
        assert Sampler()(x, [row(seed=seed, top_k=1) for _ in range(8)])[0] == greedy
        assert Sampler()(x, [row(seed=seed, top_p=1e-6) for _ in range(8)])[0] == greedy
        assert Sampler()(x, [row(seed=seed, min_p=1.0) for _ in range(8)])[0] == greedy


def draw(logits, n, **kw):
    """n samples from one row of logits with one seed: steps 0..n-1 of the counter (the step is
    the number of output tokens the row already has; these tokens have no effect without penalties)."""
    s = Sampler()
    counts = torch.zeros(logits.shape[-1])
    for k in range(n):
        t = s(logits.unsqueeze(0), [row(seed=1234, output=[0] * k, **kw)])[0][0]
        counts[t] += 1
    return counts / n


def test_sampling_distributions():
    x = logits_for([0.5, 0.3, 0.15, 0.05])
    freq = draw(x, 2000)
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.04)
    freq = draw(x, 1000, min_p=0.5)  # keeps 0.5 and 0.3, renormalized: 0.625 / 0.375
    assert freq[2] == 0 and freq[3] == 0 and abs(freq[0] - 0.625) < 0.05
    freq = draw(x, 1000, top_p=0.85)  # keeps 0.5, 0.3, 0.15
    assert freq[3] == 0 and abs(freq[0] - 0.5 / 0.95) < 0.05
    freq = draw(x, 1000, top_k=2)
    assert freq[2] == 0 and freq[3] == 0
    # temperature 0.5 squares the probabilities: [1, 4] -> 0.2 / 0.8
    freq = draw(torch.tensor([0.0, math.log(2.0)]), 2000, temperature=0.5)
    assert abs(freq[1] - 0.8) < 0.03


def test_same_seed_same_tokens_whatever_the_batch():
    torch.manual_seed(2)
    steps = [torch.randn(5, 64) for _ in range(20)]
    s = Sampler()

    def run(position, companions):
        others = [row(seed=100 + i, temperature=1.3) if i % 2 else row() for i in range(companions)]
        out = []
        for x in steps:
            target = row(seed=42, temperature=0.9, top_p=0.95, output=out)  # step = len(out)
            rows = others[:position] + [target] + others[position:]
            lg = x[: len(rows)].clone()
            lg[position] = x[4]  # the target's logits are the same whatever its row index
            out.append(s(lg, rows)[0][position])
        return out

    ref = run(0, 0)
    assert run(0, 3) == ref and run(2, 4) == ref and run(1, 1) == ref
    assert len(set(ref)) > 3  # it really sampled
    other = [s(x[4:5], [row(seed=43, temperature=0.9, top_p=0.95, output=ref[:k])])[0][0]
             for k, x in enumerate(steps)]
    assert other != ref


def test_rows_without_generator_use_the_sampler_generator():
    x = torch.randn(1, 1000)
    a = [Sampler(make_generator(7))(x, [row()])[0][0] for _ in range(3)]
    s = Sampler(make_generator(7))
    b = [s(x, [row()])[0][0] for _ in range(3)]
    assert a[0] == b[0] and len(set(a)) == 1


def test_min_tokens_masks_eos_and_stop_token_ids():
    x = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]])  # eos=2 is the favourite, then stop id 3
    s = Sampler()
    kw = dict(temperature=0, min_tokens=2, stop_token_ids=[3], eos=(2,))
    assert s(x, [row(output=[], **kw)])[0] == [4]
    assert s(x, [row(output=[1], **kw)])[0] == [4]
    assert s(x, [row(output=[1, 1], **kw)])[0] == [2]  # min_tokens reached
    # eos stays masked even with ignore_eos
    assert s(x, [row(output=[1], ignore_eos=True, **kw)])[0] == [4]
    # sampled rows too: eos / stop ids never come out while masked
    for seed in range(20):
        assert s(x, [row(output=[], seed=seed, temperature=5.0, min_tokens=2,
                         stop_token_ids=[3], eos=(2,))])[0][0] not in (2, 3)


def test_min_tokens_masks_every_eos_id():
    """A model may end a turn with any of several EOS ids (Llama 3: 128001, 128008, 128009):
    only the first was masked, so the others came out as text before min_tokens."""
    x = torch.tensor([[0.0, 1.0, 5.0, 3.0, 4.5]])  # eos ids 2 and 4 lead
    s = Sampler()
    assert s(x, [row(output=[], temperature=0, min_tokens=2, eos=(2, 4))])[0] == [3]
    assert s(x, [row(output=[1, 1], temperature=0, min_tokens=2, eos=(2, 4))])[0] == [2]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_row_with_no_token_left_is_the_requests_fault_not_the_models(temperature):
    """A constraint's mask leaves only EOS, and min_tokens bans it: nothing can be sampled.
    That was reported as the model's fault (internal: non-finite logits), a 500 at the
    gateway; a NaN from the model still is."""
    x = torch.full((2, 5), -INF)
    x[:, 2] = 1.0  # the mask's one allowed token: eos
    x[1, 0] = float("nan")
    s = Sampler()
    s(x, [row(output=[], temperature=temperature, seed=1, min_tokens=3, eos=(2,))] * 2)
    mine, model = s.row_errors[0], s.row_errors[1]
    assert mine.code == "invalid_request" and "no token" in mine.message, mine
    assert "min_tokens=3" in mine.message
    assert model.code == "internal" and "non-finite" in model.message


def test_logprobs_use_raw_logits_and_contain_the_sampled_token():
    torch.manual_seed(3)
    x = torch.randn(3, 40)
    raw = torch.log_softmax(x, dim=-1)
    rows = [row(seed=5, logprobs=3, temperature=2.0, repetition_penalty=1.3, prompt=[1, 2]),
            row(temperature=0, logprobs=0),
            row(temperature=0)]
    toks, lps = Sampler()(x, rows)
    assert lps[2] is None
    top3 = torch.topk(raw[0], 3).indices.tolist()
    assert set(top3) <= set(lps[0]) and toks[0] in lps[0]
    assert len(lps[0]) in (3, 4)
    for t, v in lps[0].items():
        assert v == pytest.approx(raw[0, t].item(), abs=1e-6)
        assert v <= 0.0
    assert list(lps[1]) == [toks[1]] and lps[1][toks[1]] == pytest.approx(raw[1].max().item())
    # probabilities of the top entries add up to at most 1
    assert sum(math.exp(v) for v in lps[0].values()) <= 1.0 + 1e-6


def test_logprobs_of_greedy_row_are_topk():
    x = logits_for([0.5, 0.3, 0.15, 0.05]).unsqueeze(0)
    toks, lps = Sampler()(x, [row(temperature=0, logprobs=2)])
    assert toks == [0]
    assert lps[0] == pytest.approx({0: math.log(0.5), 1: math.log(0.3)}, abs=1e-6)


def test_logprobs_are_the_same_whether_every_row_asks_or_only_some():
    """Every row asking skips the copy of the asking rows' logits: the values must not move."""
    torch.manual_seed(7)
    x = torch.randn(4, 300) * 3
    every = [row(temperature=0, logprobs=k) for k in (5, 0, 2, 5)]
    some = [every[0], row(temperature=0), every[2], row(temperature=0)]
    toks_all, lp_all = Sampler()(x, every)
    toks_some, lp_some = Sampler()(x, some)
    assert toks_all == toks_some
    assert lp_some[0] == lp_all[0] and lp_some[2] == lp_all[2]  # exactly, not approximately
    assert lp_some[1] is None and lp_some[3] is None and list(lp_all[1]) == [toks_all[1]]
    raw = torch.log_softmax(x, dim=-1)
    assert list(lp_all[3]) == torch.topk(raw[3], 5).indices.tolist()


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, 5), [row()])
