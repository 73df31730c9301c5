"""Context-parallel attention on whatever devices exist: conformance, then time.

    python benchmarks/multi_device.py [--length 4096] [--heads 8] [--head-dim 64]
                                      [--world-size 2 4] [--no-jax] [--no-torch] [--repeat 3]

Runs unchanged on a CPU machine and on a machine with several GPUs (or TPUs):

* JAX: the devices of ``jax.devices()``; with a single CPU device, ``jax_num_cpu_devices`` is
  set to the largest world size first (host devices that share the CPU cores). A mesh of the
  first ``N`` devices, axis ``"seq"``.
* torch: ``N`` spawned ranks on 127.0.0.1; NCCL with one GPU per rank when
  ``torch.cuda.device_count() >= N``, else gloo on the CPU.

For each world size it first runs the conformance checks of ``conformance.context_parallel``
(output and gradients of every strategy against the float64 reference, small shapes) on those
devices, then times forward + backward of ``context_parallel_attention`` (causal, zig-zag,
float32, batch 1) for every strategy next to single-device ``blockwise_attention`` on the whole
sequence, in the same run: the ``vs 1 device`` column is the ratio of the two (best of
``--repeat``). On devices that share cores (CPU host devices, gloo ranks on one machine) the
ratio shows the communication and scheduling overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from conformance import context_parallel as ccp  # noqa: E402

STRATEGIES = ("ring", "all_gather", "ulysses")


def _best(fn, repeat: int) -> float:  # noqa: ANN001
    """Best wall time of ``repeat`` calls after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _inputs(length: int, heads: int, head_dim: int, world: int) -> dict[str, np.ndarray]:
    """float32 query, key, value and grad_output in the zig-zag layout of ``world`` ranks."""
    rng = np.random.default_rng(0)
    shape = (1, heads, length, head_dim)
    order = ccp.cp.positions(length, world, True)
    return {n: rng.standard_normal(shape).astype(np.float32)[..., order, :]
            for n in ("query", "key", "value", "grad_output")}


# ------------------------------------------------------------------------------------------
# JAX
# ------------------------------------------------------------------------------------------


def jax_devices(world_sizes: list[int]) -> list:
    """The JAX devices; a lone CPU device becomes ``max(world_sizes)`` host devices."""
    import jax

    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
        try:
            jax.config.update("jax_num_cpu_devices", max(world_sizes))
        except RuntimeError:  # JAX already started: keep its devices
            pass
    devices = jax.devices()
    if len(devices) == 1 and devices[0].platform == "cpu":
        raise SystemExit("one CPU device: run in a fresh process (jax_num_cpu_devices)")
    return devices


def jax_conformance(world_sizes: list[int]) -> list:
    """The conformance rows of ``conformance.context_parallel`` on the first N devices."""
    from functools import partial

    import jax
    from jax.sharding import Mesh

    from jax_attn import context_parallel as jcp

    devices, rows = jax_devices(world_sizes), []
    for world in [w for w in world_sizes if w <= len(devices)]:
        mesh = Mesh(np.array(devices[:world]), ("seq",))
        for strategy in STRATEGIES:
            for case in ccp.CASES:
                x = ccp.inputs_for(case, world)
                attend = partial(jcp.context_parallel_attention, mesh=mesh,
                                 **ccp.options_for(case, strategy))

                def both(q, k, v, g, attend=attend):  # noqa: ANN001, ANN202
                    output, pullback = jax.vjp(attend, q, k, v)
                    return (output, *pullback(g))

                values = jax.jit(both)(x["query"], x["key"], x["value"], x["grad_output"])
                actual = dict(zip(ccp.STEPS, (np.asarray(a) for a in values), strict=True))
                rows += ccp.check_steps("jax", world, strategy, case, actual)
    return rows


def jax_times(length: int, heads: int, head_dim: int, world_sizes: list[int],
              repeat: int) -> list[dict]:
    """Forward + backward of every strategy, and of blockwise_attention on one device."""
    from functools import partial

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import jax_attn as ja

    devices, rows = jax_devices(world_sizes), []
    x = _inputs(length, heads, head_dim, 1)
    on_one = {n: jax.device_put(a, devices[0]) for n, a in x.items()}

    def train_step(attend):  # noqa: ANN001, ANN202
        def step(q, k, v, g):  # noqa: ANN001, ANN202
            output, pullback = jax.vjp(attend, q, k, v)
            return (output, *pullback(g))
        return jax.jit(step)

    single = train_step(partial(ja.blockwise_attention, is_causal=True))
    args = [on_one[n] for n in ("query", "key", "value", "grad_output")]
    base = _best(lambda: jax.block_until_ready(single(*args)), repeat)
    rows.append({"framework": "jax", "devices": 1, "strategy": "blockwise", "s": base})
    for world in [w for w in world_sizes if w <= len(devices)]:
        mesh = Mesh(np.array(devices[:world]), ("seq",))
        sharding = NamedSharding(mesh, PartitionSpec(None, None, "seq", None))
        x = _inputs(length, heads, head_dim, world)
        args = [jax.device_put(jnp.asarray(x[n]), sharding)
                for n in ("query", "key", "value", "grad_output")]
        for strategy in STRATEGIES:
            if heads % world:
                continue
            step = train_step(partial(ja.context_parallel_attention, mesh=mesh,
                                      strategy=strategy, is_causal=True, load_balance=True))
            seconds = _best(lambda step=step, args=args: jax.block_until_ready(step(*args)),
                            repeat)
            rows.append({"framework": "jax", "devices": world, "strategy": strategy,
                         "s": seconds, "vs": seconds / base})
    return rows


# ------------------------------------------------------------------------------------------
# torch
# ------------------------------------------------------------------------------------------


def _torch_rank(rank: int, world: int, port: int, length: int, heads: int, head_dim: int,
                repeat: int, out_dir: str) -> None:
    """One rank: conformance rows, then the timing of every strategy (rank 0 writes both)."""
    import datetime
    import json

    import torch
    import torch.distributed as dist

    from torch_attn import context_parallel as tcp

    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device(f"cuda:{rank}") if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    else:  # CPU ranks share the cores: no more threads than cores in all
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    rows: list = []
    for strategy in STRATEGIES:
        for case in ccp.CASES:
            x = ccp.inputs_for(case, world)
            q, k, v = (torch.tensor(ccp.shard(x[n], world, rank), device=device)
                       .requires_grad_(True) for n in ("query", "key", "value"))
            out = tcp.context_parallel_attention(q, k, v, **ccp.options_for(case, strategy))
            out.backward(torch.tensor(ccp.shard(x["grad_output"], world, rank), device=device))
            actual = {"output": out.detach().cpu().numpy(), "grad_query": q.grad.cpu().numpy(),
                      "grad_key": k.grad.cpu().numpy(), "grad_value": v.grad.cpu().numpy()}
            rows += [r.__dict__ for r in ccp.check_steps("torch", world, strategy, case, actual,
                                                         rank)]
    x = _inputs(length, heads, head_dim, world)
    q, k, v, g = (torch.tensor(ccp.shard(x[n], world, rank), device=device)
                  for n in ("query", "key", "value", "grad_output"))
    times = []
    for strategy in STRATEGIES:
        if heads % world:
            continue

        def step(strategy: str = strategy) -> None:
            inputs = [t.detach().requires_grad_(True) for t in (q, k, v)]
            out = tcp.context_parallel_attention(*inputs, strategy=strategy, is_causal=True,
                                                 load_balance=True)
            out.backward(g)
            if gpu:
                torch.cuda.synchronize()
            dist.barrier()

        times.append({"framework": "torch", "devices": world, "strategy": strategy,
                      "s": _best(step, repeat), "backend": "nccl" if gpu else "gloo"})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rows": rows, "times": times}))
    dist.destroy_process_group()


def torch_single(length: int, heads: int, head_dim: int, repeat: int) -> dict:
    """blockwise_attention forward + backward on one device (one GPU, or the CPU)."""
    import torch

    import torch_attn as ta

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    x = _inputs(length, heads, head_dim, 1)
    q, k, v, g = (torch.tensor(x[n], device=device)
                  for n in ("query", "key", "value", "grad_output"))

    def step() -> None:
        inputs = [t.detach().requires_grad_(True) for t in (q, k, v)]
        ta.blockwise_attention(*inputs, is_causal=True).backward(g)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return {"framework": "torch", "devices": 1, "strategy": "blockwise", "s": _best(step, repeat)}


def torch_world(world: int, length: int, heads: int, head_dim: int, repeat: int) -> tuple:
    """Spawn ``world`` ranks (deadline 600 s); their conformance rows and times."""
    import json
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _torch_rank, args=(world, ccp.free_port(), length, heads, head_dim, repeat,
                               out_dir), nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + 600
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"torch world of {world}: no result after 600 s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
    rows = ccp.merge_ranks([ccp.CPResult(**row) for rank in ranks for row in rank["rows"]])
    times = ranks[0]["times"]  # every rank waits at a barrier: rank 0's time is the world's
    return rows, times


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------


def time_table(rows: list[dict]) -> str:
    """Markdown: framework, devices, strategy, seconds, ratio to one device."""
    lines = ["| framework | devices | strategy | fwd+bwd ms | vs 1 device |",
             "|---|---:|---|---:|---:|"]
    for r in rows:
        vs = f"{r['vs']:.2f}" if "vs" in r else "1.00"
        name = r["strategy"] + (f" ({r['backend']})" if "backend" in r else "")
        lines.append(f"| {r['framework']} | {r['devices']} | {name} | {1e3 * r['s']:.1f} | "
                     f"{vs} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--world-size", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-jax", action="store_true")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args(argv)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"length {args.length}, {args.heads} heads, head_dim {args.head_dim}, causal, "
          f"zig-zag, float32, batch 1")
    failed = 0
    for framework in [f for f in ("jax", "torch") if not getattr(args, f"no_{f}")]:
        if framework == "jax":
            rows = jax_conformance(args.world_size)
            times = jax_times(args.length, args.heads, args.head_dim, args.world_size,
                              args.repeat)
        else:
            base = torch_single(args.length, args.heads, args.head_dim, args.repeat)
            rows, times = [], [base]
            for world in args.world_size:
                world_rows, world_times = torch_world(world, args.length, args.heads,
                                                      args.head_dim, args.repeat)
                rows += world_rows
                times += [{**t, "vs": t["s"] / base["s"]} for t in world_times]
        bad = [r for r in rows if not r.passed]
        failed += len(bad)
        print(f"\n{framework} conformance: {len(rows) - len(bad)}/{len(rows)} checks pass")
        for r in bad:
            print(r.line())
        print()
        print(time_table(times), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
