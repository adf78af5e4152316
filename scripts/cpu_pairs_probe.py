"""How fast each of this machine's CPUs runs a busy Python loop, alone and beside a second busy
loop pinned to each other CPU.

A host-bound engine runs at the speed of the core its thread landed on. A virtual machine lists
every vCPU as its own core, but what the host runs beside a vCPU (another of its hyperthreads,
other guests) sets that vCPU's speed, which the guest cannot see (its steal time stays 0). On an
H200 machine the 16 vCPUs ran the loop at 16.0 to 26.7 M loops/s alone. The ratio printed per
pair is the first loop's speed beside the second over its speed alone (1.0: independent; a pair
consistently below it shares a physical core).

    python scripts/cpu_pairs_probe.py                # CPUs 0-3 against every other
    python scripts/cpu_pairs_probe.py --bases 0 5 --seconds 0.3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time


def spin(cpu: int, seconds: float, start: float, out) -> None:
    os.sched_setaffinity(0, {cpu})
    while time.time() < start:
        pass
    n, end = 0, start + seconds
    while time.time() < end:
        for _ in range(2000):
            n += 1
    out.put((cpu, n / seconds))


def run(cpus: list[int], seconds: float) -> dict[int, float]:
    out = mp.Queue()
    start = time.time() + 0.2
    procs = [mp.Process(target=spin, args=(cpu, seconds, start, out)) for cpu in cpus]
    for p in procs:
        p.start()
    rates = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bases", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    alone = {cpu: run([cpu], args.seconds)[cpu] for cpu in cpus}
    print("alone, loops/s (M):", " ".join(f"{cpu}:{alone[cpu] / 1e6:.1f}" for cpu in cpus))
    for base in args.bases:
        ratios = []
        for other in cpus:
            if other != base:
                ratios.append(f"{other}:{run([base, other], args.seconds)[base] / alone[base]:.2f}")
        print(f"cpu {base} beside:", " ".join(ratios), flush=True)


if __name__ == "__main__":
    main()
