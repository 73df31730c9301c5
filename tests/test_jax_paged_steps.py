"""jax_attn's paged kernel in its several steps per chunk (issue 23's speed fix): a chunk of
pages attended in steps of the online softmax, a step's pages copied one page at a time (pages
of ``TAKE_POSITIONS`` positions or more) or all at once (smaller pages), equals the float64
reference and the contiguous cache, and a jitted step compiles once for every table.

``tests/test_paged_decoding.py`` runs one page per step (its chunks are two pages, in
``SPLIT_KV["steps"]`` = 2 steps); here a chunk of two pages is one step (``steps`` = 1), its
pages copied in two takes of one page (``TAKE_POSITIONS`` = 1, the path of pages of 256
positions) or in one take of two (the path of small pages). The expected values come from
``conformance.cases.reference`` via ``test_paged_decoding._check_paged``.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_paged_decoding import NUM_BLOCKS, _check_paged, _history, _paged_call

import attention_rules


@pytest.mark.slow
@pytest.mark.parametrize("take_positions", [1, None], ids=["a_page_per_take", "one_take"])
def test_steps_of_several_pages_equal_the_reference(monkeypatch, take_positions):
    pytest.importorskip("jax")
    import jax

    import jax_attn
    from conformance.running import backends
    from jax_attn import paged

    for name, value in (("chunk", 8), ("min_kv_len", 12), ("steps", 1)):
        monkeypatch.setitem(attention_rules.SPLIT_KV, name, value)
    if take_positions is not None:
        monkeypatch.setattr(paged, "TAKE_POSITIONS", take_positions)
    backend = backends.get("jax")
    cache, truth = _history(backend)
    _check_paged(backend, cache, truth, [3, 0, 2], q_len=1)
    if take_positions is not None:  # q_len 3, sinks and a soft-cap: one plan is enough
        sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
        _check_paged(backend, cache, truth, [0, 3], q_len=3, sinks=sinks, softcap=5.0)
    # jitted with the table traced: one program for every table and length of these shapes
    query, table, lens = _paged_call(backend, cache, [0, 2])
    step = jax.jit(jax_attn.paged_attention)
    step.clear_cache()  # jit's cache is shared by every jit of the function (other tests')
    good = np.asarray(step(query, cache.key_pages, cache.value_pages, table, lens))
    np.testing.assert_allclose(good, np.asarray(cache.attend(query, [0, 2])), rtol=1e-5,
                               atol=1e-5)
    shorter = np.asarray(step(query, cache.key_pages, cache.value_pages, table[::-1],
                              lens[::-1] - 1))
    assert np.isfinite(shorter).all() and not np.allclose(shorter, good[::-1])
    bad = np.asarray(step(query, cache.key_pages, cache.value_pages,
                          table.at[1, 1].set(NUM_BLOCKS + 1), lens))
    assert np.isnan(bad[1]).all() and np.allclose(bad[0], good[0]), "NaN, never a wrong number"
    assert step._cache_size() == 1, "a jitted step compiles once per shape"
