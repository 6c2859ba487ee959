"""Draft trees on the native kernels: attention.c's vs_attention_tree and decoder.c's tree sequences honour a tree's
mask, and a node computes exactly what a chain holding its path computes (what one-token steps give)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import no_native_reason, tiny_model
from verispec.cache import KVCache, tree_mask, tree_positions
from verispec.kernels import native
from verispec.model.fused import FusedForward

needs_native = pytest.mark.skipif(not native.available(), reason=no_native_reason())
PARENTS = [-1, -1, 0, 0, 1, 2, 2, 4, 6, -1, 8]  # 11 nodes, depth up to 5, several siblings
BF16 = torch.bfloat16


def _path(parents: list[int], node: int) -> list[int]:  # rows of the anchor (0) and the node's ancestors, in order
    rows = [node + 1]
    while parents[node] >= 0:
        node = parents[node]
        rows.append(node + 1)
    return [0, *reversed(rows)]


@needs_native
@pytest.mark.parametrize("cached", [0, 5, 37])
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (2, 1, 64)])
def test_tree_attention_honours_the_mask(cached, heads, kv_heads, d):
    g = torch.Generator().manual_seed(cached + d)
    t = len(PARENTS) + 1
    q = torch.randn(1, heads, t, d, generator=g)
    k, v = (torch.randn(1, kv_heads, cached + t, d, generator=g) for _ in range(2))
    mask = tree_mask(cached, PARENTS, torch.device("cpu"))  # [T, cached + T]
    out = native.attention(q, k, v, causal=False, tree=native.tree_rows(mask, cached))
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@needs_native
def test_a_tree_node_attends_bit_identically_to_its_path_as_a_chain():
    g = torch.Generator().manual_seed(0)
    cached, t, d = 29, len(PARENTS) + 1, 32
    q = torch.randn(1, 4, t, d, generator=g)
    k, v = (torch.randn(1, 2, cached + t, d, generator=g) for _ in range(2))
    tree = native.attention(q, k, v, causal=False,
                            tree=native.tree_rows(tree_mask(cached, PARENTS, torch.device("cpu")), cached))
    for node in range(len(PARENTS)):
        rows = _path(PARENTS, node)
        keys = torch.cat([torch.arange(cached), cached + torch.tensor(rows)])
        chain = native.attention(q[:, :, rows], k[:, :, keys].contiguous(), v[:, :, keys].contiguous(), causal=True)
        assert torch.equal(tree[:, :, node + 1], chain[:, :, -1])


def test_masks_the_kernels_cannot_honour_are_declined():
    mask = tree_mask(6, PARENTS, torch.device("cpu"))
    assert native.tree_rows(mask, 6) is not None
    hidden = mask.clone()
    hidden[3, 2] = False  # a row that does not see the whole cache
    assert native.tree_rows(hidden, 6) is None
    cache = KVCache(1, 1, 8, 32)
    cache.length = 6
    assert FusedForward.tree(torch.arange(len(PARENTS) + 1), hidden, cache) is False
    assert FusedForward.tree(None, None, cache) is None


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("head_dim", [16, 32])  # 32: several 8-lane blocks a key, as real heads have
def test_a_tree_forward_runs_natively_and_each_node_equals_its_chain(dtype, head_dim):
    """The decoder's tree rows: every node's logits equal, bit for bit, the last logits of a forward over its path
    after the same cache (and so a one-token step's), and the torch path's to rounding."""
    model = tiny_model(3, head_dim=head_dim).to(dtype).pack_weights()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, vocab, (1, 17), generator=g)
    nodes = torch.randint(0, vocab, (1, len(PARENTS) + 1), generator=g)  # the anchor, then the nodes
    calls = []
    decoder = model.fused.decoder
    inner = decoder.forward

    def spy(tokens, caches, *a, **kw):
        calls.append([c[5] is not None for c in caches])
        return inner(tokens, caches, *a, **kw)

    decoder.forward = spy
    try:
        with torch.inference_mode():
            assert model.forward_path == "native"
            cache = KVCache.for_model(model, max_len=64)
            model(prompt[:, :-1], cache=cache)
            start = cache.length
            mask = tree_mask(start, PARENTS, torch.device("cpu"))
            pos = tree_positions(start, PARENTS, torch.device("cpu"))[None]
            tokens = torch.cat([prompt[:, -1:], nodes[:, 1:]], dim=1)
            tree_logits = model(tokens, positions=pos, cache=cache, attn_mask=mask)[0]
            assert calls[-1] == [True]  # the tree went through decoder.c, as a tree
            for node in range(len(PARENTS)):
                cache.truncate(start)
                rows = _path(PARENTS, node)
                chain = model(tokens[:, rows], cache=cache)[0]
                assert torch.equal(tree_logits[0, node + 1], chain[0, -1]), node
            cache.truncate(start)
            fused, model.fused = model.fused, None
            try:
                torch_logits = model(tokens, positions=pos, cache=cache, attn_mask=mask)[0]
            finally:
                model.fused = fused
    finally:
        decoder.forward = inner
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(tree_logits.float(), torch_logits.float(), rtol=tol, atol=tol)


@needs_native
def test_bad_tree_rows_fail_before_anything_is_committed():
    model = tiny_model(3)
    decoder = model.fused.decoder
    cache = KVCache.for_model(model, max_len=16)
    n = 3
    pos = torch.arange(n)
    tails = torch.tensor([[0, 0, 0], [0, 1, 0], [0, 1, 7]])  # row 2 lists cache row 7 of only 3
    with pytest.raises(ValueError, match=r"failed \(-2\)"):
        decoder.forward(torch.tensor([1, 2, 3]), [(cache.k[:, 0], cache.v[:, 0], 0, n, 0, (pos, tails,
                                                                                        torch.tensor([1, 2, 3])))],
                        torch.tensor([2]))
    assert cache.length == 0
