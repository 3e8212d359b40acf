"""The grammar-bitmask kernel (kernels/cpu/cpu_token_mask.c) against its numpy reference: the
same logits bit for bit, rows outside the mask untouched, rows allowing nothing left as they were."""
import numpy as np
import pytest
import torch

from genpool.kernels.cpu import token_mask

pytestmark = pytest.mark.skipif(token_mask._kernel() is None, reason="no C compiler here")


def random_masks(n: int, words: int, gen: np.random.Generator) -> torch.Tensor:
    m = gen.integers(0, 2 ** 32, size=(n, words), dtype=np.uint64).astype(np.uint32)
    m[0] = 0                                # allows nothing
    m[1] = 0xFFFFFFFF                       # allows everything the mask covers
    m[2] = 0
    m[2, 1] = 1 << 5                        # exactly one token: 32 + 5
    return torch.from_numpy(m.view(np.int32).copy())


@pytest.mark.parametrize("vocab,words", [(1000, 32), (1000, 31), (49152, 1536), (70, 3)])
def test_mask_matches_reference(vocab, words):
    gen = np.random.default_rng(vocab + words)
    logits = torch.from_numpy(gen.standard_normal((9, vocab), dtype=np.float32))
    rows = [4, 0, 7, 2, 8]
    masks = random_masks(len(rows), words, gen)
    want = logits.numpy().copy()
    want_allowed = token_mask.apply_token_bitmask_ref(want, np.asarray(rows), masks.numpy())
    got_allowed = token_mask.apply_token_bitmask(logits, rows, masks)
    np.testing.assert_array_equal(logits.numpy(), want)
    np.testing.assert_array_equal(got_allowed, want_allowed)
    assert not got_allowed[0] and got_allowed[1] and got_allowed[2]
    assert np.isfinite(logits.numpy()[[1, 3, 5, 6]]).all()  # rows no mask names are untouched
    assert np.isfinite(logits.numpy()[4]).all()             # the row allowing nothing too
    only = np.flatnonzero(np.isfinite(logits.numpy()[7]))
    assert only.tolist() == [32 + 5]
    if words * 32 < vocab:  # tokens past the mask are never allowed
        assert np.isneginf(logits.numpy()[0, words * 32:]).all()


def test_bad_arguments_are_refused():
    logits = torch.zeros(2, 64)
    mask = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="outside"):
        token_mask.apply_token_bitmask(logits, [2], mask)
    with pytest.raises(ValueError, match="float32"):
        token_mask.apply_token_bitmask(logits.double(), [0], mask)
    with pytest.raises(ValueError, match="int32"):
        token_mask.apply_token_bitmask(logits, [0, 1], mask)


def test_bits_past_the_vocab_allow_nothing():
    logits = torch.ones(1, 40)
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 1] = 1 << 13  # token 45: past the 40-token vocab
    assert token_mask.apply_token_bitmask(logits, [0], mask).tolist() == [False]
    assert token_mask.apply_token_bitmask_ref(logits.numpy(), np.asarray([0]), mask.numpy()).tolist() == [False]
    assert (logits == 1).all()
