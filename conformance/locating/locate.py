"""``locate(a, b, inputs)``: the first stage where two attention blocks part, and how.

Both blocks run on the same seeded input ``x (batch, seq, d_model)`` at the same positions,
with the same weights (A's, copied into B; B's into A when A gives none), in the run's dtype.
Each stage of B is compared with A's under the harness's one tolerance rule
(``comparing.compare``): the expected value is A run in float64 (a copy of A with its weights
in float64), and the baseline error ``e`` is A's own error in the run's dtype against it, so
``|B - A64| <= atol + rtol·|A64| + k·e`` passes (``spec.TOLERANCES``). A block that cannot be
copied to float64 is compared against A in the run's dtype with ``e = eps · max|A|``.

The first stage that fails is named, with its worst error per sequence position (the query
position for the scores and weights) and a verdict: "grows with position" when position 0
agrees and the error rises with the position (a RoPE mistake: the layout, the frequencies),
"everywhere", or "at positions ...". Then the input is shrunk: the first batch row alone, then
the shortest prefix of the sequence, that still part first at that stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..comparing.compare import compare
from . import render
from .blocks import STAGES, BadBlock, Block, as_block

#: The dtypes a locate run takes.
DTYPES = ("float32", "float64")


@dataclass
class LocateInputs:
    """The inputs both blocks get: ``x (batch, seq, d_model)`` drawn from a standard normal
    with ``seed`` (or given), ``positions (batch, seq)`` (default ``0..seq-1``), the dtype
    the blocks run in, and whether the attention is causal."""

    batch: int = 2
    seq: int = 16
    seed: int = 0
    dtype: str = "float32"
    is_causal: bool = True
    positions: Any = None
    x: Any = None

    def arrays(self, d_model: int) -> tuple[np.ndarray, np.ndarray]:
        """``x`` as float64 ``(batch, seq, d_model)`` (rounded to the run's dtype) and
        ``positions`` as int64 ``(batch, seq)``."""
        if self.x is None:
            rng = np.random.default_rng(self.seed)
            x = rng.standard_normal((self.batch, self.seq, d_model))
        else:
            x = np.asarray(self.x, np.float64)
            if x.ndim != 3 or x.shape[-1] != d_model:
                raise BadBlock(f"inputs: x must be (batch, seq, d_model={d_model}); got x.shape="
                               f"{x.shape}")
        x = x.astype(self.dtype).astype(np.float64)
        batch, seq = x.shape[:2]
        positions = np.arange(seq) if self.positions is None else np.asarray(self.positions)
        if positions.dtype.kind not in "iu":
            raise BadBlock(f"inputs: positions must be integers; got {positions.dtype}")
        try:
            positions = np.broadcast_to(positions, (batch, seq)).astype(np.int64)
        except ValueError:
            raise BadBlock(f"inputs: positions {positions.shape} do not fit (batch, seq) = "
                           f"{(batch, seq)}") from None
        return x, positions


@dataclass
class StageError:
    """One stage: the worst ``|B - A|`` relative to its bound (at most 1 passes), the worst
    absolute difference, and the worst ratio per sequence position."""

    stage: str
    ratio: float
    max_abs: float
    passed: bool
    per_position: list[float] = field(default_factory=list)
    note: str = ""
    drift: list[float] = field(default_factory=list)  # mean |B - A| / mean |A| per position


@dataclass
class LocateResult:
    """What ``locate`` found: the stages compared (in the pipeline's order), the first that
    parts (None when they agree), its verdict on positions, the shrunk input, or the problem
    that stopped it (bad input)."""

    a: str
    b: str
    dtype: str = "float32"
    batch: int = 0
    seq: int = 0
    is_causal: bool = True
    stages: list[StageError] = field(default_factory=list)
    first: str | None = None
    verdict: str = ""
    parting_positions: list[int] = field(default_factory=list)
    shrunk: dict[str, Any] | None = None
    problem: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def agree(self) -> bool:
        """True when every compared stage passes (and there was no problem)."""
        return not self.problem and self.first is None and bool(self.stages)

    @property
    def exit_code(self) -> int:
        """0: they agree; 1: they part; 2: bad input."""
        return 2 if self.problem or not self.stages else (0 if self.agree else 1)

    def stage(self, name: str) -> StageError | None:
        """The compared stage ``name``, or None."""
        return next((s for s in self.stages if s.stage == name), None)

    def text(self, width: int = 100) -> str:
        """The result as readable text (``render.text``)."""
        return render.text(self, width)


def _inputs(inputs: Any) -> LocateInputs:
    """``inputs``: None, a ``LocateInputs``, a dict of its fields, or ``x`` itself."""
    if inputs is None:
        return LocateInputs()
    if isinstance(inputs, LocateInputs):
        return inputs
    if isinstance(inputs, dict):
        unknown = set(inputs) - {f.name for f in dataclasses.fields(LocateInputs)}
        if unknown:
            raise BadBlock(f"inputs: unknown keys {sorted(unknown)}; known: "
                           f"{[f.name for f in dataclasses.fields(LocateInputs)]}")
        return LocateInputs(**inputs)
    return LocateInputs(x=inputs)


class _Pair:
    """The two blocks in the run's dtype with the same weights, and A's float64 twin."""

    def __init__(self, a: Block, b: Block, dtype: str, notes: list[str]) -> None:
        self.dtype = dtype
        weights, giver = a.export(), "A"
        if weights is None:
            weights, giver = b.export(), "B"
        self.a = a.with_weights(weights, dtype)
        self.b = b.with_weights(weights, dtype)
        if weights is None or (self.a is None and self.b is None):
            notes.append("weights not copied: neither block gives its weights "
                         "(export_weights) to one that takes them (load_weights)")
        elif self.a is None or self.b is None:
            taker = "A" if self.a is None else "B"
            if taker != giver:
                notes.append(f"weights not copied: {taker} takes none (load_weights)")
        else:
            notes.append(f"weights: {giver}'s, copied into both")
        self.a, self.b = self.a or a, self.b or b
        self.reference = a.with_weights(weights, "float64")  # None: A's own weights
        if self.reference is None:
            notes.append("A has no float64 copy: B is compared with A in the run's dtype, "
                         "baseline eps·max|A|")

    def compare(self, x: np.ndarray, positions: np.ndarray, is_causal: bool
                ) -> list[StageError]:
        """Every stage both blocks give, B against A, in the pipeline's order."""
        run = x.astype(self.dtype)
        found_a = _call(self.a, run, positions, is_causal)
        found_b = _call(self.b, run, positions, is_causal)
        reference = (None if self.reference is None
                     else _call(self.reference, x, positions, is_causal))
        errors = []
        for name in STAGES:
            if name not in found_a or name not in found_b:
                continue
            errors.append(_stage_error(name, found_a[name], found_b[name],
                                       None if reference is None else reference.get(name),
                                       self.dtype))
        return errors


def _call(block: Block, x: np.ndarray, positions: np.ndarray, is_causal: bool
          ) -> dict[str, np.ndarray]:
    """``block.stages``; any exception becomes a ``BadBlock`` naming the block."""
    try:
        return block.stages(x, positions, is_causal)
    except BadBlock:
        raise
    except Exception as exc:  # noqa: BLE001 - a block's failure is the verdict, not a crash
        raise BadBlock(f"{block.name}: stages(x {x.shape}, positions {positions.shape}, "
                       f"is_causal={is_causal}) raised {type(exc).__name__}: {exc}") from None


def _stage_error(name: str, a: np.ndarray, b: np.ndarray, reference: np.ndarray | None,
                 dtype: str) -> StageError:
    """B's stage against A's float64 reference (or A itself) under the tolerance rule, overall
    and per sequence position (axis 2 of ``(batch, heads, seq, dim)``)."""
    if a.shape != b.shape:
        return StageError(name, float("inf"), float("inf"), False,
                          note=f"shapes differ: A {a.shape}, B {b.shape}")
    expected = a if reference is None or reference.shape != a.shape else reference
    with np.errstate(all="ignore"):
        finite = np.isfinite(expected) & np.isfinite(a)
        if reference is None:
            scale = float(np.max(np.abs(a[finite]), initial=0.0))
            baseline = float(np.finfo(dtype).eps) * scale
        else:
            baseline = float(np.max(np.abs(a - expected)[finite], initial=0.0))
        step = compare(name, b, expected, baseline, dtype)
        both = np.isfinite(b) & finite
        max_abs = float(np.max(np.abs(b - expected)[both], initial=0.0))
        per_position = [compare(name, b[:, :, p], expected[:, :, p], baseline, dtype).ratio
                        for p in range(a.shape[2])]
        difference = np.where(both, np.abs(b - expected), 0.0).mean(axis=(0, 1, 3))
        size = np.where(finite, np.abs(expected), 0.0).mean(axis=(0, 1, 3))
        drift = np.where(size > 0, difference / np.where(size > 0, size, 1.0), difference)
    return StageError(name, step.ratio, max_abs, step.passed, per_position, step.note,
                      [float(d) for d in drift])


def _first(errors: list[StageError]) -> StageError | None:
    return next((e for e in errors if not e.passed), None)


def _ranges(positions: list[int]) -> str:
    """``[1, 2, 3, 7]`` → ``"1-3, 7"``."""
    parts, start = [], None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            parts.append(str(start) if start == p else f"{start}-{p}")
            start = None
    return ", ".join(parts)


def position_verdict(per_position: list[float], drift: list[float] | None = None
                     ) -> tuple[str, list[int]]:
    """The verdict on a stage's worst ratio per position (and its mean relative difference
    per position, ``drift``), and the positions that part: "grows with position" when
    position 0 agrees and the later ones part, each of them or with a difference that rises
    with the position (rank correlation >= 0.5: the signature of a rotation that is wrong
    by an angle proportional to the position); else "everywhere" or "at positions ..."."""
    ratios = np.asarray(per_position, np.float64)
    parting = [int(p) for p in np.flatnonzero(~(ratios <= 1.0))]
    if not parting:
        return "", []
    if len(ratios) >= 3 and ratios[0] <= 1.0 and len(parting) >= 2:
        if parting == list(range(1, len(ratios))):
            return "grows with position", parting
        values = np.asarray(drift if drift else ratios, np.float64)
        capped = np.where(np.isfinite(values), values, np.finfo(np.float64).max)
        ranks = np.argsort(np.argsort(capped, kind="stable"), kind="stable")
        rho = float(np.corrcoef(np.arange(len(values)), ranks)[0, 1])
        if rho >= 0.5:
            return "grows with position", parting
    if len(parting) == len(ratios):
        return "everywhere", parting
    return f"at positions {_ranges(parting)}", parting


def _shrink(pair: _Pair, x: np.ndarray, positions: np.ndarray, is_causal: bool, stage: str
            ) -> dict[str, Any]:
    """The smallest input that still parts first at ``stage``: one batch row if one does
    (the first such), then the shortest prefix of the sequence."""

    def parts(xs: np.ndarray, ps: np.ndarray) -> bool:
        first = _first(pair.compare(xs, ps, is_causal))
        return first is not None and first.stage == stage

    rows = slice(None)
    row = None
    if x.shape[0] > 1:
        for i in range(x.shape[0]):
            if parts(x[i:i + 1], positions[i:i + 1]):
                rows, row = slice(i, i + 1), i
                break
    xs, ps = x[rows], positions[rows]
    for length in range(1, x.shape[1] + 1):
        if length == x.shape[1] or parts(xs[:, :length], ps[:, :length]):
            return {"batch": xs.shape[0], "row": row, "seq": length,
                    "positions": ps[0, :length].tolist()}
    return {"batch": xs.shape[0], "row": row, "seq": x.shape[1],
            "positions": ps[0].tolist()}  # pragma: no cover - the loop returns


def locate(a: Any, b: Any, inputs: Any = None, *, shrink: bool = True) -> LocateResult:
    """Run two attention blocks on the same inputs and weights and name the first stage
    where they part.

    Args:
      a: the reference block: anything with ``stages(x, positions=..., is_causal=...)`` (the
        spec's ``MultiHeadAttention``, a plugin's), a transformers attention layer, or a
        ``blocks.Block``.
      b: the block compared with it.
      inputs: None (the defaults of ``LocateInputs``), a ``LocateInputs``, a dict of its
        fields, or ``x (batch, seq, d_model)`` itself.
      shrink: look for the smallest input that still parts (a few more runs).

    Returns:
      a ``LocateResult``: every stage's error, the first that parts (None when they agree),
      its verdict on positions and the shrunk input; a bad input (no block, different
      d_model, a block that raises) gives ``problem``, never an exception.
    """
    names = ("A", "B")
    result = LocateResult(a=_describe(a), b=_describe(b))
    try:
        blocks = [as_block(obj, name) for obj, name in zip((a, b), names, strict=True)]
        inputs = _inputs(inputs)
        if inputs.dtype not in DTYPES:
            raise BadBlock(f"inputs: dtype must be one of {DTYPES}; got {inputs.dtype!r}")
        d_models = [blk.d_model for blk in blocks]
        if None not in d_models and d_models[0] != d_models[1]:
            raise BadBlock(f"the blocks' d_model differ: A {d_models[0]}, B {d_models[1]}")
        d_model = next((d for d in d_models if d is not None), None)
        if d_model is None:
            d_model = inputs.x.shape[-1] if inputs.x is not None else None
        if d_model is None:
            raise BadBlock("neither block says its d_model (an attribute d_model): give x")
        x, positions = inputs.arrays(d_model)
        result.dtype, result.is_causal = inputs.dtype, inputs.is_causal
        result.batch, result.seq = x.shape[:2]
        pair = _Pair(blocks[0], blocks[1], inputs.dtype, result.notes)
        result.stages = pair.compare(x, positions, inputs.is_causal)
        if not result.stages:
            raise BadBlock("the blocks have no stage in common; stages are named "
                           f"{', '.join(STAGES)}")
        first = _first(result.stages)
        if first is None:
            return result
        result.first = first.stage
        if first.per_position:
            result.verdict, result.parting_positions = position_verdict(first.per_position,
                                                                        first.drift)
        else:
            result.verdict = first.note
        if shrink and first.per_position:
            result.shrunk = _shrink(pair, x, positions, inputs.is_causal, first.stage)
    except BadBlock as exc:
        result.problem = str(exc)
    return result


def _describe(obj: Any) -> str:
    """A short name of a block: its class and module."""
    if isinstance(obj, Block):
        return obj.name
    cls = type(obj)
    return f"{cls.__module__.split('.')[0]}.{cls.__name__}"


__all__ = ["DTYPES", "LocateInputs", "LocateResult", "StageError", "locate",
           "position_verdict"]
