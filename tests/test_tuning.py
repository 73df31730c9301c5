"""numpy_attn's tuner (``numpy_attn/_fast/tuning.py``): choices that change speed, never values.

Each choice of the blocked path (block sizes, the exponential unit, the product orders) gives the
same bits on every call, from any thread; two choices both meet the tolerance rule against the
float64 reference (``spec.FAST_PATH_RULES["tuning"]``). The suite runs the fixed table
(``conftest.py``); one slow test runs the fast-path test files again under the second fixed
choice (``ATTENTION_TUNING=alternate``). How the tuner decides and keeps its choices is
``test_tuning_decisions.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from numerics import assert_matches_reference, assert_vjp_matches_reference
from subprocesses import timeout

import numpy_attn
from numpy_attn import _fast
from numpy_attn._fast import tuning

ROOT = Path(__file__).resolve().parents[1]


# A representative subset of the fast path's inputs: (query, key, value) shapes and options.
CASES = {
    "full_gqa": (((1, 4, 70, 16), (1, 2, 53, 16), (1, 2, 53, 12)), {}),
    "causal": (((2, 2, 64, 16), (2, 2, 64, 16), (2, 2, 64, 16)), {"is_causal": True}),
    "window_bottom_right": (((1, 2, 40, 8), (1, 2, 75, 8), (1, 2, 75, 8)),
                            {"window": (9, 3), "causal_alignment": "bottom_right"}),
    "mask_bias": (((1, 2, 48, 8), (1, 2, 57, 8), (1, 2, 57, 8)), {"mask": True, "bias": True}),
    "softcap_sinks": (((1, 2, 50, 8), (1, 2, 50, 8), (1, 2, 50, 8)),
                      {"softcap": 5.0, "sinks": True, "is_causal": True}),
}


FIXED = tuning.Choice(16, 16, 32, False, True, False)  # the suite's small fixed table


FORCED = {"block_q": 24, "block_kv": 8, "block_q_backward": 40, "exp2": True,
          "keys_first": True, "keys_first_backward": True}


@pytest.fixture
def small_fixed_table(monkeypatch):
    """Every input of CASES on the blocked path, the fixed table ``FIXED``; ``used`` lists the
    (blocks, exp2, keys_first) each blocked forward and VJP ran with."""
    monkeypatch.setattr(_fast, "MIN_SCORES", 0)
    monkeypatch.setattr(_fast, "MIN_Q_LEN", 8)
    for name, value in (("BLOCK_Q", FIXED.block_q), ("BLOCK_KV", FIXED.block_kv),
                        ("BLOCK_Q_BACKWARD", FIXED.block_q_backward)):
        monkeypatch.setattr(_fast, name, value)
    monkeypatch.setattr(_fast.forward, "USE_EXP2", FIXED.exp2)
    monkeypatch.setattr(_fast, "KEYS_FIRST", FIXED.keys_first)
    monkeypatch.setattr(_fast, "KEYS_FIRST_BACKWARD", FIXED.keys_first_backward)
    used = []
    real_forward, real_vjp = _fast.forward.blocked_attention, _fast.backward.blocked_attention_vjp

    def forward(*args, blocks, exp2=None, keys_first=None, **kwargs):
        used.append(("forward", blocks, exp2, keys_first))
        return real_forward(*args, blocks=blocks, exp2=exp2, keys_first=keys_first, **kwargs)

    def vjp(*args, blocks, exp2=None, keys_first=None, **kwargs):
        used.append(("vjp", blocks, exp2, keys_first))
        return real_vjp(*args, blocks=blocks, exp2=exp2, keys_first=keys_first, **kwargs)

    monkeypatch.setattr(_fast.forward, "blocked_attention", forward)
    monkeypatch.setattr(_fast.backward, "blocked_attention_vjp", vjp)
    yield used
    tuning.set_tuning(None)


def _inputs(case: str) -> tuple[dict, dict]:
    """float32 arrays (query, key, value, grad_output and the case's mask, bias, sinks) and the
    other options."""
    shapes, options = CASES[case]
    gen = np.random.default_rng(sorted(CASES).index(case))
    arrays = {name: gen.standard_normal(shape).astype(np.float32)
              for name, shape in zip(("query", "key", "value"), shapes, strict=True)}
    scores = shapes[0][:-1] + shapes[1][-2:-1]
    arrays["grad_output"] = gen.standard_normal(shapes[0][:-1] + shapes[2][-1:]).astype(
        np.float32)
    options = dict(options)
    if options.pop("mask", False):
        arrays["mask"] = gen.random(scores) > 0.3
        arrays["mask"][..., 5, :] = False  # a fully masked row
    if options.pop("bias", False):
        arrays["bias"] = gen.standard_normal(scores).astype(np.float32)
    if options.pop("sinks", False):
        arrays["sinks"] = gen.standard_normal(shapes[0][-3]).astype(np.float32)
    return arrays, options


def _run(arrays: dict, options: dict) -> list[np.ndarray]:
    """Output, lse and the gradients of the blocked path (query, key, value, bias or None, and
    sinks with sinks)."""
    inputs = {name: x for name, x in arrays.items() if name != "grad_output"}
    output, lse = numpy_attn.scaled_dot_product_attention(**inputs, return_lse=True, **options)
    grads = numpy_attn.scaled_dot_product_attention_vjp(
        inputs.pop("query"), inputs.pop("key"), inputs.pop("value"), arrays["grad_output"],
        **inputs, **options)
    return [output, lse, *grads]


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_choices_each_repeat_bitwise_and_both_meet_the_tolerance(small_fixed_table, case):
    """The fixed table, its alternate (blocks halved, the other exponential and product orders)
    and a forced table (blocks that divide nothing, both products keys first): each gives the
    same bits twice and from another thread, and each is within the tolerance rule of the
    float64 reference, forward and VJP."""
    arrays, options = _inputs(case)
    results = {}
    for mode in ("off", "alternate", FORCED):
        tuning.set_tuning(mode)
        small_fixed_table.clear()
        first = _run(arrays, options)
        blocks = list(small_fixed_table)
        again = _run(arrays, options)
        box = []
        thread = threading.Thread(target=lambda box=box: box.append(_run(arrays, options)))
        thread.start()
        thread.join()
        for other in (again, box[0]):
            for a, b in zip(first, other, strict=True):
                assert (a is None and b is None) or a.tobytes() == b.tobytes(), \
                    f"{mode}: not the same bits"
        results[str(mode)] = (first, blocks)
    off, alternate, forced = (results[key][1] for key in results)
    # the blocks each choice ran (forward, then the VJP's forward and tiles)
    assert off == [("forward", (16, 16), False, True), ("forward", (16, 16), False, True),
                   ("vjp", (16, 16, 32), False, False)]
    assert alternate == [("forward", (8, 16), True, False), ("forward", (8, 8), True, False),
                         ("vjp", (8, 8, 16), True, True)]
    assert forced == [("forward", (24, 8), True, True), ("forward", (24, 8), True, True),
                      ("vjp", (24, 8, 40), True, True)]
    reference = {name: x.astype(np.float64) for name, x in arrays.items()
                 if name not in ("grad_output",)}
    for mode, (values, _) in results.items():
        what = f"{case}, ATTENTION_TUNING={mode}"
        assert_matches_reference(values[0], reference, "float32", what=what, **options)
        assert_vjp_matches_reference(values[2:], dict(reference, grad_output=arrays[
            "grad_output"].astype(np.float64)), "float32", what=what, **options)


def test_the_switch_parses_and_names_itself_on_bad_values(monkeypatch):
    for on in ("", " On ", "1", "TRUE", "on"):
        monkeypatch.setenv("ATTENTION_TUNING", on)
        assert tuning.tuning_mode() == "on"
    for off in ("OFF", " 0 ", "false"):
        monkeypatch.setenv("ATTENTION_TUNING", off)
        assert tuning.tuning_mode() == "off"
    monkeypatch.setenv("ATTENTION_TUNING", " Alternate ")
    assert tuning.tuning_mode() == "alternate"
    monkeypatch.setenv("ATTENTION_TUNING", "block_q=1,exp2=TRUE,keys_first=0,"
                                           "keys_first_backward=true")
    assert tuning.tuning_mode() == {"block_q": 1, "exp2": True, "keys_first": False,
                                    "keys_first_backward": True}
    monkeypatch.setenv("ATTENTION_TUNING", "exp2=yes")
    with pytest.raises(ValueError, match="exp2, keys_first, keys_first_backward 0 or 1"):
        tuning.tuning_mode()
    monkeypatch.setenv("ATTENTION_TUNING", "off")
    assert tuning.tuning_mode() == "off"
    monkeypatch.setenv("ATTENTION_TUNING", " block_q=64, exp2=1, keys_first=false ")
    assert tuning.tuning_mode() == {"block_q": 64, "exp2": True, "keys_first": False}
    monkeypatch.delenv("ATTENTION_TUNING")
    assert tuning.tuning_mode() == "on"
    for bad in ("fast", "block_q=0", "block_q=x", "blocks=64", "exp2=2", "keys_first=64"):
        monkeypatch.setenv("ATTENTION_TUNING", bad)
        with pytest.raises(ValueError, match="ATTENTION_TUNING: expected 'on', 'off'"):
            tuning.tuning_mode()
    with pytest.raises(ValueError, match="set_tuning: expected"):
        tuning.set_tuning({"block_q": True})
    tuning.set_tuning("off")
    assert tuning.tuning_mode() == "off"  # set_tuning wins over the environment
    tuning.set_tuning(None)


@pytest.mark.slow
def test_the_fast_path_tests_pass_under_the_second_choice():
    """The fast-path conformance and repeatability tests, run again with
    ``ATTENTION_TUNING=alternate`` (every block halved, the other exponential and product
    orders); deselected: the
    tests that check the fixed table's own numbers (its block sizes, its exponential's bound)."""
    env = dict(os.environ, ATTENTION_TUNING="alternate")
    files = ["tests/test_fast_forward_numpy.py", "tests/test_fast_backward_numpy.py",
             "tests/test_concurrency.py", "tests/test_masks_and_mods_fast.py"]
    pinned = "not default_blocks_at_the_real_threshold and not skips_the_shift_exactly"
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n",
                          "0", "-x", "-k", pinned, *files], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout(900))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_the_alternate_halves_every_block_down_to_one_and_flips_every_switch():
    assert tuning.Choice(9, 5, 3, True, False, True).alternate() == tuning.Choice(
        4, 2, 1, False, True, False)
    assert tuning.Choice(1, 1, 1, False, True, False).alternate() == tuning.Choice(
        1, 1, 1, True, False, True)
