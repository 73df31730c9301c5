"""Arrays as jax_attn's rooms see them: what the rules see of an input (``_describe``,
``_describe_lengths``, ``_describe_parts``), a validated input as a JAX array, the compute
dtype, the grouped-query head bookkeeping (query head ``h`` meets kv head ``h // groups``),
dtype names and devices. Nothing here validates but ``attention_rules``' checks of what an
input is (the public functions validate, with ``attention_rules``).

The private rooms of jax_attn form one ladder, each importing only the rooms before it:
``_arrays < _masking < _steps < _tiles < _fast`` (a package: ``slicing < forward < backward <
__init__``). The public files (``functional < backward < modules``, ``blockwise``, ``varlen``,
``masks``, ``kv_cache``, ``paged``, ``context_blocks < context_parallel``, ``integrations``)
sit above every private room.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules


def _describe(fn: str, name: str, x: Any) -> rules.ArrayInfo | None:
    """What the rules see of an input: ``(shape, dtype name)``; None for None. A Python list,
    tuple or scalar is refused (TypeError): it has no dtype of its own."""
    if x is None:
        return None
    rules.check_array(fn, name, x)
    return tuple(np.shape(x)), _dtype_name(x)  # jax: the dtype as given, before x64 rules


def _describe_lengths(kv_lengths: Any) -> rules.ArrayInfo | None:
    """``(shape, dtype name)`` of ``kv_lengths`` (a list of ints is welcome)."""
    if kv_lengths is None:
        return None
    return tuple(np.shape(kv_lengths)), _dtype_name(kv_lengths)  # jax: the dtype as given


def _describe_parts(fn: str, name: str, parts: Any) -> list[rules.ArrayInfo]:
    """``merge_attention``'s partial results as the rules see them: a list or tuple of arrays,
    ``name[i]`` each."""
    rules.check_parts(fn, name, parts)
    return [_describe(fn, f"{name}[{i}]", x) for i, x in enumerate(parts)]


def _array(x: Any) -> jax.Array | None:
    """A validated input as a JAX array; None stays None."""
    return None if x is None else jnp.asarray(x)


def _check_scores(fn: str, name: str, x: Any) -> rules.ArrayInfo:
    """A floating array of rank >= 2 (scores or weights); its ``(shape, dtype name)``."""
    return rules.check_score_array(fn, name, _describe(fn, name, x))


def _to_compute(x: jax.Array) -> jax.Array:
    """Half types up to float32; float32 and float64 unchanged (no copy)."""
    return x.astype(rules.compute_dtype(x.dtype.name))


def _group_heads(x: jax.Array, groups: int) -> jax.Array:
    """``(..., heads, T, D)`` → ``(..., kv_heads, groups, T, D)``: query head ``h`` is
    ``(h // groups, h % groups)``, so it meets kv head ``h // groups``."""
    return x.reshape(x.shape[:-3] + (x.shape[-3] // groups, groups) + x.shape[-2:])


def _groups(x_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> int:
    return x_shape[-3] // kv_shape[-3] if len(x_shape) >= 3 else 1


def _merged(shape: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """Undo ``_group_heads``: ``(..., kv_heads, groups, T, S)`` → ``(..., heads, T, S)``."""
    return rules.merged_heads(shape, groups)


def _dtype_name(x: Any) -> str:
    # The dtype as given, before JAX's x64 canonicalisation (int64 stays "int64" in messages).
    return np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype).name


def _check_device(fn: str, device: Any) -> Any:
    # JAX arrays live on a jax.Device; a platform name ("cpu", "gpu") means its first device.
    if device is None or isinstance(device, jax.Device):
        return device
    if isinstance(device, str):
        try:
            return jax.devices(device)[0]
        except RuntimeError:
            pass
    raise ValueError(
        f"{fn}: device must be None, a jax.Device or a platform name such as 'cpu'; "
        f"got device={device!r}"
    )


def _place(array: jax.Array, device: Any) -> jax.Array:
    # Only an explicit device moves the mask; None keeps JAX's default placement (and jit's).
    return array if device is None else jax.device_put(array, device)


def _cache_dtype(fn: str, dtype: Any) -> jnp.dtype:
    """A cache's ``dtype`` argument (``KVCache.empty``, ``PagedKVCache``): a dtype name
    (``"float32"``) or a JAX/NumPy dtype; the spec's TypeError naming ``dtype`` for a name
    JAX does not know."""
    try:
        return jnp.dtype(dtype)
    except TypeError:
        rules.check_float_inputs(fn, dtype=str(dtype))  # raises: not a supported dtype
        raise

