"""Per-device memory of context-parallel attention, forward + backward, JAX and torch.

    python benchmarks/context_parallel_memory.py [--lengths 4096 16384] [--no-jax] [--no-torch]

Batch 1, 8 heads (kv_heads 8), head_dim 64, float32, causal, the zig-zag layout; every row is
one call of forward + backward, next to single-device ``blockwise_attention`` on the whole
sequence measured the same way (the ``vs 1 device`` column). Each framework is measured the
way it can be:

* **JAX** (``jax_memory``): ``memory_analysis()`` of the compiled per-device program (one
  ``jit`` of forward + backward; compiled, never run): its arguments (the shards of ``q``,
  ``k``, ``v``, ``dO``), its outputs (``O``, ``dQ``, ``dK``, ``dV``) and XLA's temporaries, the
  peak of every buffer its schedule keeps alive at once.
* **torch** (``torch_memory``): CPU tensors have no allocator statistics
  (``torch.cuda.max_memory_allocated`` has no CPU twin), so ``LiveTensors``, a
  ``TorchDispatchMode``, counts every tensor storage an operator returns while the call runs
  and drops it when the storage is freed (a ``weakref.finalize`` on it); views share their
  storage and are counted once. The figure is the inputs' bytes plus the peak of that count:
  the same "arguments + outputs + temporaries" as JAX's, for the tensors torch allocates (not
  the transient scratch inside one operator, nor gloo's own buffers). The ring runs on
  ``N`` spawned gloo ranks (rank 0's peak; the ranks are symmetric under the zig-zag layout).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HEADS, HEAD_DIM = 8, 64
MIB = 2**20

_JAX = r"""
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
import jax.numpy as jnp
import numpy as np
from functools import partial
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import jax_attn as ja
for length, world, strategy, heads, dim in json.loads(sys.argv[1]):
    shape = jax.ShapeDtypeStruct((1, heads, length, dim), jnp.float32)
    if world == 1:
        attend = partial(ja.blockwise_attention, is_causal=True)
        args = [shape] * 4
    else:
        mesh = Mesh(np.array(jax.devices()[:world]), ("seq",))
        sharding = NamedSharding(mesh, PartitionSpec(None, None, "seq", None))
        attend = partial(ja.context_parallel_attention, mesh=mesh, strategy=strategy,
                         is_causal=True, load_balance=True)
        args = [jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)] * 4
    def step(q, k, v, g, attend=attend):
        out, pullback = jax.vjp(attend, q, k, v)
        return (out, *pullback(g))
    m = jax.jit(step).lower(*args).compile().memory_analysis()
    print(json.dumps({"inputs": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
                      "temp": m.temp_size_in_bytes}), flush=True)
"""


def jax_memory(*configs: tuple[int, int, str], heads: int = HEADS, head_dim: int = HEAD_DIM,
               timeout: float = 600) -> list[dict[str, int]]:
    """Bytes of one device's compiled forward + backward for each ``(length, world,
    strategy)``: ``inputs``, ``outputs``, ``temp`` and their ``total`` (one subprocess with 4
    host devices; ``world`` 1: ``blockwise_attention`` on the whole sequence)."""
    todo = [[length, world, strategy, heads, head_dim] for length, world, strategy in configs]
    out = subprocess.run([sys.executable, "-c", _JAX, json.dumps(todo)], capture_output=True,
                         text=True, cwd=ROOT, timeout=timeout)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    rows = [json.loads(line) for line in out.stdout.strip().splitlines()[-len(configs):]]
    return [{**m, "total": m["inputs"] + m["outputs"] + m["temp"]} for m in rows]


def live_tensors(held: tuple = ()) -> Any:
    """A ``TorchDispatchMode`` whose ``peak`` is the most bytes of tensor storage alive at once
    among those returned by operators while it was on (``live``: now); the storages of the
    tensors ``held`` (made before: the inputs) are never counted, not even through views."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveTensors(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self.seen = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                         for t in held}

        def _freed(self, key: tuple[int, int]) -> None:
            self.seen.discard(key)
            self.live -= key[1]

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                storage = t.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes())
                if key[1] == 0 or key in self.seen:
                    continue  # a view, an in-place result or an empty tensor
                self.seen.add(key)
                self.live += key[1]
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, key)
            return out

    return LiveTensors()


def _torch_inputs(length: int, world: int, rank: int, heads: int, head_dim: int) -> list:
    """Rank ``rank``'s float32 shards of q, k, v, dO (zig-zag layout; world 1: the whole)."""
    import numpy as np
    import torch

    from attention_rules import context_parallel as cp

    rng = np.random.default_rng(0)
    order = cp.positions(length, world, True)
    return [torch.from_numpy(np.split(
        rng.standard_normal((1, heads, length, head_dim)).astype(np.float32)[..., order, :],
        world, axis=-2)[rank].copy()) for _ in range(4)]


def _torch_peak(attend: Any, inputs: list) -> dict[str, int]:
    """Inputs' bytes and the live-tensor peak of ``attend(q, k, v).backward(dO)``."""
    q, k, v, g = (t if i == 3 else t.requires_grad_(True) for i, t in enumerate(inputs))
    mode = live_tensors(tuple(inputs))
    with mode:
        attend(q, k, v).backward(g)
    held = sum(t.nbytes for t in inputs)
    return {"inputs": held, "temp": mode.peak, "total": held + mode.peak}


def _torch_rank(rank: int, world: int, port: int, length: int, heads: int, head_dim: int,
                out_dir: str) -> None:
    """One gloo rank: the ring's forward + backward under ``live_tensors``; rank 0 writes."""
    import datetime

    import torch
    import torch.distributed as dist

    import torch_attn as ta

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    inputs = _torch_inputs(length, world, rank, heads, head_dim)
    result = _torch_peak(lambda q, k, v: ta.context_parallel_attention(
        q, k, v, strategy="ring", is_causal=True, load_balance=True), inputs)
    dist.barrier()
    if rank == 0:
        Path(out_dir, "peak.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def torch_memory(length: int, world: int, heads: int = HEADS, head_dim: int = HEAD_DIM,
                 timeout: float = 1200) -> dict[str, int]:
    """Bytes alive at the peak of one rank's forward + backward (``world`` 1: single-device
    ``blockwise_attention``, in this process; else the ring on ``world`` spawned gloo ranks)."""
    if world == 1:
        import torch

        import torch_attn as ta

        torch.set_num_threads(1)
        return _torch_peak(lambda q, k, v: ta.blockwise_attention(q, k, v, is_causal=True),
                           _torch_inputs(length, 1, 0, heads, head_dim))
    import tempfile
    import time

    import torch.multiprocessing as mp

    from conformance import context_parallel as ccp

    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _torch_rank, args=(world, ccp.free_port(), length, heads, head_dim, out_dir),
            nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"torch ring of {world}: no result after {timeout} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return json.loads(Path(out_dir, "peak.json").read_text())


def memory_table(lengths: tuple[int, ...], frameworks: tuple[str, ...] = ("jax", "torch"),
                 jax_rows: tuple[tuple[int, str], ...] = ((2, "ring"), (4, "ring"))) -> str:
    """Markdown: per-device MiB (the inputs, the peak of what the call allocates: outputs and
    temporaries, their total) and the ratio of the total to one device's, per framework,
    length and world size."""
    lines = ["| framework | tokens | devices | strategy | inputs MiB | allocated (peak) MiB | "
             "total MiB | vs 1 device |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    for framework in frameworks:
        for length in lengths:
            rows = [(1, "blockwise"), *jax_rows] if framework == "jax" else [
                (1, "blockwise"), (4, "ring")]
            measured = (jax_memory(*((length, w, s) for w, s in rows)) if framework == "jax"
                        else [torch_memory(length, world) for world, _ in rows])
            base = None
            for (world, strategy), m in zip(rows, measured, strict=True):
                base = base or m["total"]
                lines.append(f"| {framework} | {length} | {world} | {strategy} | "
                             f"{m['inputs'] / MIB:.1f} | {(m['total'] - m['inputs']) / MIB:.1f} | "
                             f"{m['total'] / MIB:.1f} | {m['total'] / base:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--no-jax", action="store_true")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args(argv)
    frameworks = tuple(f for f in ("jax", "torch") if not getattr(args, f"no_{f}"))
    print(memory_table(tuple(args.lengths), frameworks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
