"""A packed batch (a ``varlen`` case) as a padded batch with lengths, and back.

Frameworks without a packed layout take variable-length sequences as a padded batch plus the
sequences' lengths (``jax.nn.dot_product_attention``'s ``query_seq_lengths`` /
``key_value_seq_lengths``, ONNX ``Attention``'s ``nonpad_kv_seqlen``). Their peers
(``conformance.peers``) unpack a varlen case here, and ``diagnosing.alternatives`` computes a
varlen cell's hypotheses on the same padded batch (``as_sdpa``), so that what a kernel does on
padding (a finite fill, the mean of the padded values) is reproduced bit for bit. Written from
``spec.VARLEN`` alone, apart from the harness's reference of a varlen case
(``case_inputs.varlen_pieces``): a mistake in one does not hide in the other.

The padding holds zeros. Query ``i`` of sequence ``b`` sits at row ``q_start[b] + i`` of its
padded block: ``q_start`` is 0 (left-aligned, the default) or ``max_q - q_len`` (right-aligned,
``right_align_queries``: how a kernel whose causal rule aligns the queries to the end of the
valid keys, ONNX's with ``nonpad_kv_seqlen``, is given bottom-right queries of different
lengths); keys are always left-aligned, and only the keys in use (``seqused_k``) are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .inputs import CaseData


@dataclass
class Padded:
    """A packed batch of ``N`` sequences as a padded batch (zeros after each sequence)."""

    query: np.ndarray  # (N, heads, max_q, head_dim)
    key: np.ndarray  # (N, kv_heads, max_k, head_dim)
    value: np.ndarray  # (N, kv_heads, max_k, v_dim)
    q_lengths: np.ndarray  # (N,) int64
    kv_lengths: np.ndarray  # (N,) int64: the keys in use
    q_start: np.ndarray  # (N,) int64: the row of each sequence's first query

    @property
    def max_q(self) -> int:
        """The padded query length (at least 1)."""
        return self.query.shape[2]


def _block(x: np.ndarray, cu: np.ndarray, lengths: np.ndarray, start: np.ndarray,
           size: int) -> np.ndarray:
    """Tokens-first ``x (total, heads, dim)`` as ``(N, heads, size, dim)``: sequence ``b``'s
    first ``lengths[b]`` tokens (from ``cu[b]``) at rows ``start[b]:``, zeros elsewhere."""
    out = np.zeros((len(lengths), x.shape[1], size, x.shape[2]), x.dtype)
    for b, n in enumerate(lengths):
        out[b, :, start[b]:start[b] + n] = np.swapaxes(x[cu[b]:cu[b] + n], 0, 1)
    return out


def unpack(arrays: dict[str, np.ndarray], *, right_align_queries: bool = False) -> Padded:
    """A varlen case's ``query``, ``key``, ``value``, ``cu_seq_q``, ``cu_seq_k`` and
    ``seqused_k`` (optional) as a ``Padded`` batch (``block_table``: ValueError)."""
    if arrays.get("block_table") is not None:
        raise ValueError("unpack: a paged (block_table) packed batch is not unpacked here")
    cu_q = np.asarray(arrays["cu_seq_q"], np.int64)
    cu_k = np.asarray(arrays["cu_seq_k"], np.int64)
    q_len = np.diff(cu_q)
    used = arrays.get("seqused_k")
    k_len = np.diff(cu_k) if used is None else np.asarray(used, np.int64)
    max_q, max_k = max(int(q_len.max(initial=0)), 1), max(int(k_len.max(initial=0)), 1)
    q_start = max_q - q_len if right_align_queries else np.zeros_like(q_len)
    zeros = np.zeros_like(k_len)
    return Padded(_block(np.asarray(arrays["query"]), cu_q, q_len, q_start, max_q),
                  _block(np.asarray(arrays["key"]), cu_k, k_len, zeros, max_k),
                  _block(np.asarray(arrays["value"]), cu_k, k_len, zeros, max_k),
                  q_len, k_len, q_start)


def allowed(p: Padded, window_size: tuple[int, int], alignment: str = "bottom_right"
            ) -> np.ndarray:
    """``(N, 1, max_q, max_k)`` bool: query ``i`` of sequence ``b`` may attend key ``j`` when
    both are inside the sequence and ``j - i - offset`` lies in the window (``window_size``,
    -1 unbounded; ``(-1, 0)`` is causal), ``offset`` being ``kv_len - q_len`` per sequence
    (``"bottom_right"``, spec.VARLEN) or 0 (``"top_left"``)."""
    left, right = (int(w) for w in window_size)
    i = np.arange(p.max_q)[None, :, None] - p.q_start[:, None, None]  # (N, max_q, 1)
    j = np.arange(p.key.shape[2])[None, None, :]  # (1, 1, max_k)
    q_len, k_len = p.q_lengths[:, None, None], p.kv_lengths[:, None, None]
    ok = (i >= 0) & (i < q_len) & (j < k_len)
    rel = j - i - (k_len - q_len if alignment == "bottom_right" else 0)
    if left >= 0:
        ok &= rel >= -left
    if right >= 0:
        ok &= rel <= right
    return ok[:, None]


def repack(x: np.ndarray, p: Padded) -> np.ndarray:
    """A padded result ``(N, heads, max_q, ·)`` back to tokens first ``(total_q, heads, ·)``
    (the padded rows dropped)."""
    parts = [np.swapaxes(x[b, :, s:s + n], 0, 1) for b, (s, n) in
             enumerate(zip(p.q_start, p.q_lengths, strict=True))]
    return np.concatenate(parts, axis=0)


def repack_lse(lse: np.ndarray, p: Padded) -> np.ndarray:
    """A padded lse ``(N, heads, max_q)`` as ``varlen_attention``'s ``(heads, total_q)``."""
    parts = [lse[b, :, s:s + n] for b, (s, n) in enumerate(zip(p.q_start, p.q_lengths,
                                                               strict=True))]
    return np.concatenate(parts, axis=-1)


def as_sdpa(data: CaseData) -> tuple[CaseData, Padded]:
    """A varlen case as the sdpa case of its padded batch: the sequences' rules (lengths,
    ``window_size`` in the alignment of option ``causal_alignment``, bottom-right unless an
    alternative says otherwise) folded into a boolean ``mask (N, 1, max_q, max_k)``; ``scale``,
    ``softcap`` and ``sinks`` as given. Returns it and the ``Padded`` batch (for ``repack``)."""
    a, o = data.arrays, data.options
    p = unpack(a)
    arrays = {"query": p.query, "key": p.key, "value": p.value,
              "mask": allowed(p, o.get("window_size", (-1, -1)),
                              o.get("causal_alignment", "bottom_right"))}
    if a.get("sinks") is not None:
        arrays["sinks"] = a["sinks"]
    options = {n: o[n] for n in ("scale", "softcap") if o.get(n) is not None}
    return CaseData(arrays, options), p


__all__ = ["Padded", "allowed", "as_sdpa", "repack", "repack_lse", "unpack"]
