"""What ``import numpy_attn`` costs beyond ``import numpy`` (target: at most 30 ms).

    python benchmarks/import_time.py [--runs 15]

Each run is a fresh interpreter that imports NumPy, then times ``import numpy_attn`` with
``time.perf_counter``; the script prints the median and the spread over runs, and the modules
the import pulled in beyond NumPy's (``-X importtime`` gives the per-module breakdown).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CHILD = """
import sys, time
import numpy
before = set(sys.modules)
start = time.perf_counter()
import numpy_attn
elapsed = time.perf_counter() - start
new = sorted(m for m in set(sys.modules) - before if not m.startswith("numpy_attn"))
print(elapsed)
print(",".join(new))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    times, extra = [], ""
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                             check=True).stdout.splitlines()
        times.append(float(out[0]) * 1e3)
        extra = out[1] if len(out) > 1 else ""
    times.sort()
    print(f"import numpy_attn after import numpy: median {statistics.median(times):.1f} ms "
          f"(min {times[0]:.1f}, max {times[-1]:.1f}, {args.runs} fresh interpreters)")
    print(f"modules imported beyond numpy's: {extra or '(none)'}")
    print("target: <= 30 ms;", "met" if statistics.median(times) <= 30 else "MISSED")


if __name__ == "__main__":
    main()
