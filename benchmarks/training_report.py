"""The training benchmark's report (``benchmarks/training.py``): the floor, the tables, the
targets, the plot, and its section of ``benchmarks/RESULTS.md``.

``medians[T][(variant, mode, causal)]["median_s"]``: seconds of one call, median of the rounds;
``memory[(kind, causal)]``: the memory rows' measurements.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BATCH, HEADS, HEAD_DIM = 1, 8, 64
SGEMM_N = 2048  # the SGEMM rate: 2048 × 2048 @ 2048 × 2048 float32, 17 GFLOP
BACKENDS = ("torch SDPA", "torch_attn", "numpy_attn", "jax_attn", "jax.nn")
MODES = ("fwd", "fwd+bwd")
START, END = "<!-- training:start -->", "<!-- training:end -->"


def flops(mode: str, T: int, causal: bool) -> float:
    """FLOPs of the matrix products alone: 2 for the forward, 2 + 4 with the backward."""
    pairs = T * (T + 1) / 2 if causal else T * T
    return (4 if mode == "fwd" else 12) * BATCH * HEADS * pairs * HEAD_DIM



def machine() -> dict:
    import threadpoolctl

    sys.path.insert(0, str(HERE))
    from run import settings  # the machine description of benchmarks/run.py

    info = settings()
    info["threadpoolctl"] = threadpoolctl.__version__
    return info


def tables(medians: dict, rates: dict[str, float], lengths: list[int]) -> str:
    rate = max(rates.values())
    lines = []
    for mode in ("fwd+bwd", "fwd"):
        title = "forward + backward" if mode == "fwd+bwd" else "forward"
        lines += [f"#### {title}", "",
                  "| T | mask | variant | ms | × torch SDPA | of floor | causal / full |",
                  "|---|---|---|---|---|---|---|"]
        for T in lengths:
            for causal in (False, True):
                base = medians[T]["torch SDPA", mode, causal]["median_s"]
                floor = flops(mode, T, causal) / (rate * 1e9)
                lines.append(f"| {T} | {'causal' if causal else 'full'} | floor "
                             f"(products at {rate:.0f} GFLOP/s) | {floor * 1e3:.1f} "
                             f"| {floor / base:.2f} | 1.00 | |")
                for name in BACKENDS:
                    s = medians[T][name, mode, causal]["median_s"]
                    full = medians[T][name, mode, False]["median_s"]
                    ratio = f"{s / full:.2f}" if causal else ""
                    lines.append(f"| {T} | {'causal' if causal else 'full'} | {name} "
                                 f"| {s * 1e3:.1f} | {s / base:.2f} | {floor / s:.2f} "
                                 f"| {ratio} |")
        lines.append("")
    return "\n".join(lines)


def targets(medians: dict, memory: dict, lengths: list[int], tokens: int) -> str:
    """The targets of the training work, each measured value and whether it holds."""
    def m(T, name, mode, causal):
        return medians[T][name, mode, causal]["median_s"]

    rows = []
    for T in lengths:
        for causal in (False, True):
            mask = "causal" if causal else "full"
            for name, mode, limit in (("torch_attn", "fwd+bwd", 1.05), ("numpy_attn", "fwd", 1.3),
                                      ("numpy_attn", "fwd+bwd", 2.0), ("jax_attn", "fwd", 1.3),
                                      ("jax_attn", "fwd+bwd", 1.5)):
                r = m(T, name, mode, causal) / m(T, "torch SDPA", mode, causal)
                rows.append((f"{name} {mode} × torch SDPA", T, mask, f"≤ {limit}", r, r <= limit))
            r = m(T, "jax.nn", "fwd+bwd", causal) / m(T, "jax_attn", "fwd+bwd", causal)
            rows.append(("jax.nn fwd+bwd / jax_attn fwd+bwd", T, mask, "≥ 1.5", r, r >= 1.5))
        for name in BACKENDS[1:4]:
            for mode in MODES:
                r = m(T, name, mode, True) / m(T, name, mode, False)
                rows.append((f"{name} {mode} causal / full", T, "", "≤ 0.65", r, r <= 0.65))
    lines = ["#### targets", "", "| target | T | mask | limit | measured | holds |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {t} | {T} | {mask} | {limit} | {r:.2f} | {'yes' if ok else '**no**'} |"
              for t, T, mask, limit, r, ok in rows]
    for causal in (False, True):
        numpy_mem = memory.get(("numpy_attn VJP", causal), {})
        if "extra_mib" in numpy_mem:
            ok = numpy_mem["extra_mib"] <= 64
            lines.append(f"| numpy_attn VJP extra MiB, one head | {tokens:,} "
                         f"| {'causal' if causal else 'full'} | ≤ 64 | "
                         f"{numpy_mem['extra_mib']:.1f} | {'yes' if ok else '**no**'} |")
        jax_mem = memory.get(("jax_attn fwd+bwd", causal), {})
        if "largest_elements" in jax_mem:
            ok = jax_mem["largest_elements"] < jax_mem["square_elements"]
            lines.append(f"| jax_attn fwd+bwd: largest array < (T, T) | {tokens:,} "
                         f"| {'causal' if causal else 'full'} | < T·T elements | "
                         f"{jax_mem['largest_elements']:,} | {'yes' if ok else '**no**'} |")
    return "\n".join(lines) + "\n"


def memory_lines(memory: dict, tokens: int) -> str:
    if not memory:
        return ""
    lines = [f"#### memory, one head of {tokens:,} tokens", "",
             "| variant | mask | measure | value |", "|---|---|---|---|"]
    for (kind, causal), m in memory.items():
        mask = "causal" if causal else "full"
        if "error" in m:
            lines.append(f"| {kind} | {mask} | error | {m['error']} |")
        elif kind == "numpy_attn VJP":
            lines.append(f"| {kind} | {mask} | extra MiB (tracemalloc peak − gradients; "
                         f"one (T, T) float32 array: {m['square_mib']:.0f} MiB) "
                         f"| {m['extra_mib']:.1f} |")
        else:
            square = m["largest_elements"] >= m["square_elements"]
            temp = "" if m["temp_mib"] is None else f"; XLA temp {m['temp_mib']:.0f} MiB"
            lines.append(f"| {kind} | {mask} | largest jaxpr array (vs (T, T)){temp}; one call "
                         f"{m['seconds']:.1f} s | {tuple(m['largest_shape'])}: "
                         f"{'a (T, T)-sized array' if square else 'no (T, T) array'} |")
    return "\n".join(lines) + "\n"


def plot(medians: dict, rates: dict[str, float], lengths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate = max(rates.values())
    fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(12, 4.8))
    groups = [(T, causal) for T in lengths for causal in (False, True)]
    width = 0.8 / (len(BACKENDS) + 1)
    for i, name in enumerate(("floor",) + BACKENDS):
        ms, fraction = [], []
        for T, causal in groups:
            floor = flops("fwd+bwd", T, causal) / (rate * 1e9)
            s = floor if name == "floor" else medians[T][name, "fwd+bwd", causal]["median_s"]
            ms.append(s * 1e3)
            fraction.append(floor / s)
        xs = [j + (i - len(BACKENDS) / 2) * width for j in range(len(groups))]
        color = "0.6" if name == "floor" else f"C{i - 1}"
        ax_t.bar(xs, ms, width, label=name, color=color)
        if name != "floor":
            ax_f.bar(xs, fraction, width, label=name, color=color)
    labels = [f"{T}\n{'causal' if causal else 'full'}" for T, causal in groups]
    for ax, ylabel in ((ax_t, "forward + backward, median ms (log)"),
                       (ax_f, f"fraction of the floor ({rate:.0f} GFLOP/s SGEMM)")):
        ax.set_xticks(range(len(groups)), labels)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.legend(fontsize=8)
    fig.suptitle(f"batch {BATCH}, {HEADS} heads, head_dim {HEAD_DIM}, float32")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def section(command: str, info: dict, load: tuple, rates: dict, rounds: int, body: str,
            png: str) -> str:
    libs = ", ".join(f"{k} {info[k]}" for k in ("python", "numpy", "jax", "torch"))
    blas = "; ".join(f"{b['internal_api']} {b['version']} ({b['num_threads']} threads, "
                     f"{b.get('threading_layer')}"
                     + (f", {b['architecture']} kernels)" if b.get("architecture") else ")")
                     for b in info["threadpools"])
    overrides = {k: v for k, v in info.get("env", {}).items() if k.startswith("OPENBLAS")}
    return "\n".join([
        START,
        f"## Training: forward and forward + backward ({info['date'][:10]})", "",
        f"`{command}` — batch {BATCH}, {HEADS} heads, head_dim {HEAD_DIM}, float32; {rounds} "
        "interleaved rounds per length (full and causal together), median. "
        "\"× torch SDPA\": time over torch SDPA's in the same mode; \"of floor\": the matrix "
        "products alone at the measured SGEMM rate over the time (see "
        "`benchmarks/training.py`: 2 products forward, 6 forward + backward, causal counts "
        "the allowed pairs); \"causal / full\": the variant's causal time over its full time.",
        "",
        f"- Machine: {info['cpu']}, {info['usable_cores']} usable cores; load average "
        f"{load[0][0]:.2f} before, {load[1][0]:.2f} after.",
        f"- Libraries: {libs}; threadpoolctl {info['threadpoolctl']}; BLAS: {blas}; "
        f"torch threads {info['torch_num_threads']}; XLA_FLAGS "
        f"{'`' + info['XLA_FLAGS'] + '`' if info['XLA_FLAGS'] else 'empty'}; OpenBLAS "
        + (", ".join(f"`{k}={v}`" for k, v in overrides.items()) if overrides
           else "choosing its own kernels (no `OPENBLAS_*` override)") + ".",
        "- SGEMM rate (float32 " + f"{SGEMM_N}×{SGEMM_N} products, median): "
        + ", ".join(f"{name} {r:.0f} GFLOP/s" for name, r in rates.items()) + ".",
        "", body, f"![forward + backward]({png})", "", END, "",
    ])


def write_results(path: Path, text: str) -> None:
    old = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n\n"
    if START in old and END in old:
        head, rest = old.split(START, 1)
        new = head + text + rest.split(END, 1)[1].lstrip("\n")
    else:  # first time: after the title, before the earlier sections
        title, _, rest = old.partition("\n\n")
        new = title + "\n\n" + text + "\n" + rest
    path.write_text(new, encoding="utf-8")
