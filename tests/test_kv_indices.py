"""Page-table construction for FlashInfer (pipeline/backends/flashinfer/backend.py).

The reference is a plain Python walk over ``req_to_token``; the Triton kernel (interpreted on CPU,
compiled on the GPU machine by tests/gpu) and the torch fallback must both match it exactly.
"""

from __future__ import annotations

import random

import pytest
import torch

from pipeline.backends.flashinfer.backend import gather_kv_indices, host_page_meta

# compiled kernel on a GPU machine, Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(r2t, rows, seq_lens, ps):
    r2t_host = r2t.cpu()
    ids, indptr, last = [], [0], []
    for row, n in zip(rows, seq_lens):
        pages = -(-n // ps)
        ids += [int(r2t_host[row, j * ps]) // ps for j in range(pages)]
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * ps)
    return ids, indptr, last


def _pool(max_reqs, max_ctx, ps, seed):
    """req_to_token whose rows hold whole, shuffled pages (as the page allocator hands them out)."""
    g = random.Random(seed)
    pages_per_row = -(-max_ctx // ps)
    page_ids = list(range(1, max_reqs * pages_per_row + 1))
    g.shuffle(page_ids)
    r2t = torch.zeros(max_reqs, max_ctx, dtype=torch.int32)
    for r in range(max_reqs):
        for j in range(pages_per_row):
            p = page_ids[r * pages_per_row + j]
            cols = torch.arange(j * ps, min((j + 1) * ps, max_ctx))
            r2t[r, cols] = (p * ps + cols - j * ps).to(torch.int32)
    return r2t.to(DEV)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("ps", [1, 16, 64])
def test_gather_matches_python_walk(impl, ps):
    g = random.Random(ps)
    max_ctx = 300
    r2t = _pool(40, max_ctx, ps, seed=ps)
    for trial in range(4):
        b = g.choice([1, 3, 40])
        rows = g.sample(range(40), b)
        lens = [g.randint(1, max_ctx) for _ in range(b)]
        want_ids, want_indptr, want_last = _reference(r2t, rows, lens, ps)
        indptr, last, total = host_page_meta(lens, ps)
        assert indptr.tolist() == want_indptr and last.tolist() == want_last and total == want_indptr[-1]
        assert indptr.dtype == last.dtype == torch.int32
        got = gather_kv_indices(r2t, torch.tensor(rows, device=DEV), torch.tensor(lens, dtype=torch.int32, device=DEV), total, ps, impl=impl)
        assert got.dtype == torch.int32 and got.tolist() == want_ids, (trial, b, ps)


def test_gather_writes_into_given_buffer_and_leaves_the_tail():
    r2t = _pool(4, 64, 16, seed=1)
    out = torch.full((20,), -7, dtype=torch.int32, device=DEV)
    got = gather_kv_indices(r2t, torch.tensor([2, 0], device=DEV), torch.tensor([33, 1], device=DEV), 4, 16, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert got.tolist() == _reference(r2t, [2, 0], [33, 1], 16)[0]
    assert out[4:].tolist() == [-7] * 16


def test_gather_rejects_small_out_and_unknown_impl():
    r2t = _pool(2, 32, 16, seed=2)
    with pytest.raises(ValueError, match="needs 3 page ids"):
        gather_kv_indices(r2t, torch.tensor([0, 1], device=DEV), torch.tensor([32, 1], device=DEV), 3, 16,
                          out=torch.empty(2, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="contiguous int32"):
        gather_kv_indices(r2t, torch.tensor([0, 1], device=DEV), torch.tensor([32, 1], device=DEV), 3, 16,
                          out=torch.empty(8, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="impl='cuda'"):
        gather_kv_indices(r2t, torch.tensor([0], device=DEV), torch.tensor([1], device=DEV), 1, 16, impl="cuda")


def test_empty_batch():
    r2t = _pool(2, 32, 16, seed=3)
    indptr, last, total = host_page_meta([], 16)
    assert indptr.tolist() == [0] and last.tolist() == [] and total == 0
    empty = dict(device=DEV)
    assert gather_kv_indices(r2t, torch.tensor([], dtype=torch.int64, **empty), torch.tensor([], dtype=torch.int32, **empty),
                             0, 16).numel() == 0


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_gather_over_more_requests_than_one_block(impl):
    """B = 300 > the kernel's 128-wide chunk: each request's start sums pages over several chunks."""
    r2t = _pool(300, 40, 4, seed=4)
    g = random.Random(4)
    rows = list(range(300))
    g.shuffle(rows)
    lens = [g.randint(1, 40) for _ in rows]
    indptr, last, total = host_page_meta(lens, 4)  # > 64 requests: the torch-op host path
    want_ids, want_indptr, want_last = _reference(r2t, rows, lens, 4)
    assert indptr.tolist() == want_indptr and last.tolist() == want_last and total == want_indptr[-1]
    assert indptr.dtype == last.dtype == torch.int32
    got = gather_kv_indices(r2t, torch.tensor(rows, device=DEV), torch.tensor(lens, device=DEV), total, 4, impl=impl)
    assert got.tolist() == want_ids



@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_gather_honours_strides_of_every_input(impl):
    """Strided rows / lengths (slices with a step) and a column-strided req_to_token give the same ids."""
    r2t = _pool(8, 64, 16, seed=5)
    rows, lens = [1, 6, 2, 3], [9, 33, 64, 1]
    want = _reference(r2t, rows, lens, 16)[0]
    rows_s = torch.tensor([x for r in rows for x in (r, 7)], device=DEV)[::2]
    lens_s = torch.tensor([x for n in lens for x in (n, 999)], dtype=torch.int32, device=DEV)[::2]
    r2t_t = r2t.t().contiguous().t()  # same values, strides (1, 8)
    total = host_page_meta(lens, 16)[2]
    assert not rows_s.is_contiguous() and not lens_s.is_contiguous() and r2t_t.stride(1) != 1
    got = gather_kv_indices(r2t_t, rows_s, lens_s, total, 16, impl=impl)
    assert got.tolist() == want


def test_kernel_never_writes_past_the_host_total():
    """Device lengths larger than the host's page total: the Triton kernel stops at total_pages."""
    r2t = _pool(2, 64, 16, seed=6)
    out = torch.full((20,), -7, dtype=torch.int32, device=DEV)
    got = gather_kv_indices(r2t, torch.tensor([1], device=DEV), torch.tensor([64], dtype=torch.int32, device=DEV), 1,
                            16, out=out, impl="triton")
    assert got.tolist() == _reference(r2t, [1], [64], 16)[0][:1]
    assert out[1:].tolist() == [-7] * 19


def test_errors_name_the_problem_and_the_remedy(monkeypatch):
    from pipeline.backends.flashinfer import backend

    r2t = _pool(2, 32, 16, seed=7)
    with pytest.raises(ValueError, match="non-contiguous"):
        gather_kv_indices(r2t, torch.tensor([0], device=DEV), torch.tensor([1], device=DEV), 1, 16,
                          out=torch.empty(8, dtype=torch.int32, device=DEV)[::2])
    monkeypatch.setattr(backend, "_INTERPRETED", DEV == "cuda")  # the mode in which Triton cannot run on DEV
    with pytest.raises(ValueError, match="impl='triton' cannot run.*impl='auto'"):
        gather_kv_indices(r2t, torch.tensor([0], device=DEV), torch.tensor([1], device=DEV), 1, 16, impl="triton")
    got = gather_kv_indices(r2t, torch.tensor([0], device=DEV), torch.tensor([17], device=DEV), 2, 16)  # auto: torch
    assert got.tolist() == _reference(r2t, [0], [17], 16)[0]
    with pytest.raises(ValueError, match="page_size=0"):
        host_page_meta([3], 0)
    with pytest.raises(ValueError, match="seq_lens has 0"):
        host_page_meta([3, 0], 16)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_long_requests_split_over_programs(impl):
    """2 requests of 300 pages (page 1): the kernel runs 3 programs per request (grid-stride over chunks)."""
    r2t = _pool(4, 300, 1, seed=8)
    rows, lens = [3, 1], [300, 257]
    total = host_page_meta(lens, 1)[2]
    assert -(-total // (2 * 128)) == 3
    got = gather_kv_indices(r2t, torch.tensor(rows, device=DEV), torch.tensor(lens, device=DEV), total, 1, impl=impl)
    assert got.tolist() == _reference(r2t, rows, lens, 1)[0]
