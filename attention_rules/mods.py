"""The rules of chunked local attention, ALiBi, segment ids, ``score_mod`` and ``mask_mod``
(``spec.MASKS_AND_MODS``): pure Python on shapes, dtype names and numbers.

* the checks of ``chunk_size``, ``alibi_slopes``, ``segment_ids`` (one array, or a pair for
  queries and keys), ``score_mod`` and ``mask_mod``, and of what a mod returns: the same
  exception type and message in every backend;
* ``captures``: whether a mod closes over an array that is being differentiated, which sends
  jax_attn and torch_attn to their differentiable explicit steps (``spec.SCORE_MOD``);
* ``chunk_status``: whether the chunk rule and the band (causal rule, window) leave a tile
  nothing, part of it or all of it, so that every blocked path skips the same tiles.

Positions: query ``i`` sits at key position ``i + offset`` (``causal_offset``: 0 top-left,
``kv_len - q_len`` bottom-right), as in the causal rule, the window and ALiBi; the chunk of a
position ``p`` is ``p // chunk_size`` (floor division: a negative position is in no key's
chunk).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

from .checks import SUPPORTED_DTYPES, ArrayInfo, Shape, broadcast_shapes, is_int
from .tiles import key_range

#: A tile's status: no allowed position, some, or every position allowed.
NONE, SOME, ALL = 0, 1, 2


def check_chunk_size(fn: str, chunk_size: object) -> int | None:
    """``chunk_size``: None or a positive int (ValueError otherwise); returns it as an int."""
    if chunk_size is None:
        return None
    if not is_int(chunk_size) or int(chunk_size) < 1:  # type: ignore[arg-type]
        raise ValueError(
            f"{fn}: chunk_size must be a positive int (keys per chunk) or None; "
            f"got chunk_size={chunk_size!r}"
        )
    return int(chunk_size)  # type: ignore[arg-type]


def check_alibi_slopes(fn: str, alibi_slopes: ArrayInfo | None, heads: int) -> None:
    """ALiBi slopes: one floating-point slope per query head, shape ``(heads,)`` (``(1,)`` for
    inputs without a heads axis); TypeError for another dtype, ValueError for another shape."""
    if alibi_slopes is None:
        return
    shape, dtype = alibi_slopes
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{fn}: alibi_slopes must be floating point (one slope per query head); "
            f"got alibi_slopes.dtype={dtype}"
        )
    if tuple(shape) != (heads,):
        raise ValueError(
            f"{fn}: alibi_slopes must have shape (heads,) = ({heads},), one slope per query "
            f"head; got alibi_slopes.shape={tuple(shape)}"
        )


def split_segment_ids(fn: str, segment_ids: object) -> tuple[object, object, bool] | None:
    """``segment_ids`` as ``(query ids, key ids, one)``: a pair (list or tuple of two arrays)
    is the queries' and the keys' ids; one array serves both (``one`` True: queries and keys
    share positions). None stays None; another list or tuple is a ValueError."""
    if segment_ids is None:
        return None
    if isinstance(segment_ids, (list, tuple)):
        if len(segment_ids) != 2:
            raise ValueError(
                f"{fn}: segment_ids must be one array, or a pair (query_segment_ids, "
                f"kv_segment_ids); got a {type(segment_ids).__name__} of {len(segment_ids)}"
            )
        return segment_ids[0], segment_ids[1], False
    return segment_ids, segment_ids, True


def segment_pair(segment_ids: object) -> tuple[object, object] | None:
    """Validated ``segment_ids`` as ``(query ids, key ids)``: one array serves both."""
    split = split_segment_ids("segment_ids", segment_ids)
    return None if split is None else split[:2]


def describe_segment_ids(fn: str, segment_ids: object, describe: Callable
                         ) -> tuple[object, object, bool] | None:
    """``segment_ids`` (one array or a pair) as the rules see it: ``(query ids, key ids, one)``,
    each described by the backend's ``describe(fn, name, array)`` as ``(shape, dtype name)``."""
    split = split_segment_ids(fn, segment_ids)
    if split is None:
        return None
    q_ids, kv_ids, one = split
    names = ("segment_ids", "segment_ids") if one else ("segment_ids[0]", "segment_ids[1]")
    return describe(fn, names[0], q_ids), describe(fn, names[1], kv_ids), one


def check_segment_ids(
    fn: str, q_ids: ArrayInfo, kv_ids: ArrayInfo, q_shape: Shape, k_shape: Shape, one: bool
) -> None:
    """Segment ids: integers (TypeError), the queries' broadcastable to ``(..., q_len)`` and the
    keys' to ``(..., kv_len)``, ``...`` the batch axes, the last axis exactly the length
    (ValueError); one array for both needs ``q_len == kv_len`` (ValueError)."""
    batch = tuple(q_shape[:-3])
    names = ("segment_ids", "segment_ids") if one else ("segment_ids[0]", "segment_ids[1]")
    if one and q_shape[-2] != k_shape[-2]:
        raise ValueError(
            f"{fn}: one segment_ids array needs q_len == kv_len; give a pair "
            f"(query_segment_ids, kv_segment_ids); got q_len={q_shape[-2]}, "
            f"kv_len={k_shape[-2]}"
        )
    for name, (shape, dtype), length in zip(names, (q_ids, kv_ids),
                                            (q_shape[-2], k_shape[-2]), strict=True):
        if not _is_int_dtype(dtype):
            raise TypeError(f"{fn}: {name} must be integers; got {name}.dtype={dtype}")
        target = batch + (length,)
        shape = tuple(shape)
        if (not shape or shape[-1] != length or len(shape) > len(target)
                or broadcast_shapes(shape, target) != target):
            raise ValueError(
                f"{fn}: {name} must be shaped like the batch axes and the sequence, "
                f"{target} (size-1 or missing batch axes broadcast); got {name}.shape={shape}"
            )


def check_mod(fn: str, name: str, mod: object) -> Callable | None:
    """``score_mod`` / ``mask_mod``: None or a callable (TypeError otherwise)."""
    if mod is not None and not callable(mod):
        raise TypeError(
            f"{fn}: {name} must be a callable {name}(" + ("score, " if name == "score_mod" else "")
            + f"batch, head, q_idx, kv_idx) or None; got {name} of type {type(mod).__name__}"
        )
    return mod  # type: ignore[return-value]


def check_mod_result(fn: str, name: str, shape: Shape | None, dtype: str, target: Shape) -> None:
    """What a mod returned: booleans from ``mask_mod``, floating point from ``score_mod``
    (TypeError), broadcastable to the scores (tile) it was given (ValueError). ``shape`` None:
    not an array at all."""
    wanted = "booleans" if name == "mask_mod" else "floating-point scores"
    ok = dtype == "bool" if name == "mask_mod" else dtype in SUPPORTED_DTYPES
    if shape is None or not ok:
        raise TypeError(f"{fn}: {name} must return an array of {wanted}; got dtype={dtype}")
    if len(shape) > len(target) or broadcast_shapes(tuple(shape), tuple(target)) != tuple(target):
        raise ValueError(
            f"{fn}: {name} must return an array broadcastable to the scores {tuple(target)}; "
            f"got shape={tuple(shape)}"
        )


def check_mod_derivative(fn: str, score_mod: object) -> None:
    """numpy_attn's hand-written VJPs: a ``score_mod`` must carry its derivative, a method
    ``derivative(score, batch, head, q_idx, kv_idx)`` (NotImplementedError otherwise)."""
    if score_mod is not None and not callable(getattr(score_mod, "derivative", None)):
        name = getattr(score_mod, "__name__", type(score_mod).__name__)
        raise NotImplementedError(
            f"{fn}: numpy_attn differentiates by hand and score_mod={name} has no derivative; "
            f"use a ready-made mod of numpy_attn.masks (alibi_mod, softcap_mod, "
            f"relative_bias_mod), give the callable a method derivative(score, batch, head, "
            f"q_idx, kv_idx) returning d score_mod / d score, or use jax_attn or torch_attn "
            f"(autodiff)"
        )


#: How deep ``captures`` looks: a mod's closure, a container in it, a callable in that, ...
CAPTURE_DEPTH = 6


def captures(mod: object, is_differentiated: Callable[[object], bool]) -> bool:
    """Whether the callable ``mod`` captures a value ``is_differentiated`` accepts (the backend
    says which: a torch tensor requiring grad under grad mode, a jax tracer): in a function's
    closure cells, defaults and keyword defaults, a ``functools.partial``'s function and
    arguments, a bound method's object, a callable object's attributes, and the lists, tuples,
    dicts and callables in those (``CAPTURE_DEPTH`` levels). The ready-made mods
    (``ready_mods.MaskMod`` / ``ScoreMod``) capture nothing by this rule: the arrays they hold
    are constants by design (``spec.SCORE_MOD``). Module globals are not captures."""
    seen: set[int] = set()

    def walk(value: object, depth: int) -> bool:
        if is_differentiated(value):
            return True
        if depth >= CAPTURE_DEPTH or id(value) in seen or _ready_made(value):
            return False
        seen.add(id(value))
        if isinstance(value, (list, tuple, set, frozenset)):
            return any(walk(item, depth + 1) for item in value)
        if isinstance(value, dict):
            return any(walk(item, depth + 1) for item in value.values())
        if isinstance(value, (type, types.ModuleType)) or not callable(value):
            return False
        return any(walk(item, depth + 1) for item in _captured(value))

    return mod is not None and walk(mod, 0)


def _captured(fn: object) -> list:
    """What one callable holds: closure cells, defaults, a partial's parts, attributes."""
    if isinstance(fn, types.FunctionType):
        cells = [cell.cell_contents for cell in fn.__closure__ or () if _filled(cell)]
        return cells + list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
    if isinstance(fn, functools.partial):
        return [fn.func, *fn.args, *fn.keywords.values()]
    if isinstance(fn, types.MethodType):
        return [fn.__func__, fn.__self__]
    return list(getattr(fn, "__dict__", {}).values())


def _ready_made(value: object) -> bool:
    """A ``ready_mods.MaskMod`` / ``ScoreMod`` (by its class's module: ``ready_mods`` imports
    this module, so this one does not import it)."""
    return type(value).__module__ == __name__.rsplit(".", 1)[0] + ".ready_mods"


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 -- an empty cell raises
    except ValueError:
        return False
    return True


def _band_status(q0: int, q1: int, k0: int, k1: int, lo: float, hi: float) -> int:
    """The band ``lo <= j - i <= hi`` on rows ``[q0, q1)`` and keys ``[k0, k1)``."""
    if q1 <= q0 or k1 <= k0:
        return NONE
    d_min, d_max = k0 - (q1 - 1), (k1 - 1) - q0
    if max(lo, d_min) > min(hi, d_max):
        return NONE
    return ALL if d_min >= lo and d_max <= hi else SOME


def chunk_status(
    q0: int, q1: int, k0: int, k1: int, lo: float, hi: float, offset: int,
    chunk_size: int | None,
) -> int:
    """``NONE``, ``SOME`` or ``ALL`` of the positions of rows ``[q0, q1)`` and keys ``[k0, k1)``
    that the band ``lo <= j - i <= hi`` and the chunk rule ``(i + offset) // chunk_size ==
    j // chunk_size`` (None: no chunk rule) both allow. Exact: each chunk the rows and keys
    share is tested against the band."""
    if chunk_size is None:
        return _band_status(q0, q1, k0, k1, lo, hi)
    if q1 <= q0 or k1 <= k0:
        return NONE
    c = chunk_size
    first = max((q0 + offset) // c, k0 // c)
    last = min((q1 - 1 + offset) // c, (k1 - 1) // c)
    statuses = []
    for chunk in range(first, last + 1):
        rows = (max(q0, chunk * c - offset), min(q1, (chunk + 1) * c - offset))
        keys = (max(k0, chunk * c), min(k1, (chunk + 1) * c))
        statuses.append(_band_status(*rows, *keys, lo, hi))
    if not any(statuses):
        return NONE
    one_chunk = (q0 + offset) // c == (q1 - 1 + offset) // c == k0 // c == (k1 - 1) // c
    return ALL if one_chunk and statuses == [ALL] else SOME


def chunk_keys(i0: int, i1: int, kv_len: int, offset: int, chunk_size: int | None
               ) -> tuple[int, int]:
    """The keys ``[k0, k1)`` the chunks of query rows ``[i0, i1)`` cover (every key for no
    chunk rule); ``k0 == k1`` when no row has a key in its chunk."""
    if chunk_size is None or i1 <= i0:
        return (0, kv_len) if i1 > i0 else (0, 0)
    c = chunk_size
    k0 = min(max(0, (i0 + offset) // c * c), kv_len)
    k1 = max(min(kv_len, ((i1 - 1 + offset) // c + 1) * c), k0)
    return k0, k1


def blocks_of(length: int, size: int) -> list[tuple[int, int]]:
    """``[(0, size), (size, 2 size), ...]`` covering ``length`` (the last one shorter)."""
    return [(s, min(s + size, length)) for s in range(0, length, max(size, 1))]


def structural_statuses(
    q_len: int, kv_len: int, block_q: int, block_kv: int, lo: float, hi: float, offset: int,
    chunk_size: int | None,
) -> list[list[int]]:
    """``chunk_status`` of every ``(block_q, block_kv)`` tile: rows of query blocks, columns of
    key blocks (the backends refine them with segment ids and ``mask_mod``)."""
    n_kv = -(-kv_len // block_kv) if block_kv else 0
    rows = []
    for q0, q1 in blocks_of(q_len, block_q):
        row = [NONE] * n_kv
        k0, k1, a, b = key_range(q0, q1, kv_len, lo, hi)  # keys any row sees; all rows see
        k0, k1 = max(k0, chunk_keys(q0, q1, kv_len, offset, chunk_size)[0]), min(
            k1, chunk_keys(q0, q1, kv_len, offset, chunk_size)[1])
        for block in range(k0 // block_kv, -(-k1 // block_kv)) if k1 > k0 else ():
            b0, b1 = block * block_kv, min((block + 1) * block_kv, kv_len)
            if chunk_size is None:  # the band alone: every key of [a, b) for every row
                row[block] = ALL if a <= b0 and b1 <= b else _band_status(q0, q1, b0, b1, lo, hi)
            else:
                row[block] = chunk_status(q0, q1, b0, b1, lo, hi, offset, chunk_size)
        rows.append(row)
    return rows


def _is_int_dtype(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))
