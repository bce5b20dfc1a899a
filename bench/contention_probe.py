#!/usr/bin/env python
"""How fast one rank's kernels run when a second rank runs the same kernels at the same time.

    tools/run.sh python bench/contention_probe.py [--rounds 3] [--reps 15] [--out bench/results/contention.jsonl]

Issue 35 asks two CPU ranks of ``flux_ulysses2`` (Flux-shaped, 4352 tokens, one thread per rank) for
a 1.90x speedup over one rank. ``bench/profile_step.py`` shows where a two-rank step's time goes: the
attention and matrix-multiply kernels themselves take more than half of the one-rank time at world
size 2. This probe separates the machine from the pack: each rank's own kernels at world size 2
(attention of half the heads over every token; the linear layers over half the tokens), with no
collective, no ComfyUI and no runtime of this pack, timed in one process alone and then in two
processes at once (each one thread, as two ranks run), in turn for ``--rounds`` rounds. If the
kernels slow down by a factor ``f`` when two run at once, no implementation of Ulysses 2 can beat
``2 / f`` on this machine, peers included.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import torch
import torch.nn.functional as F

from scenarios import FLUX  # bench/, beside this file


def shapes(world: int = 2) -> dict:
    """One rank's kernel shapes of ``flux_ulysses2`` at ``world`` ranks."""
    tokens = FLUX.tokens
    return {"heads": FLUX.heads // world, "tokens": tokens, "head_dim": FLUX.hidden // FLUX.heads,
            "rows": tokens // world, "hidden": FLUX.hidden, "mlp": 4 * FLUX.hidden}


def kernels(reps: int, queue) -> None:
    """Median ms of the attention and of one MLP-sized linear layer, one thread."""
    torch.set_num_threads(1)
    s = shapes()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s["heads"], s["tokens"], s["head_dim"], generator=gen) for _ in range(3))
    x = torch.randn(s["rows"], s["hidden"], generator=gen)
    w, b = torch.randn(s["mlp"], s["hidden"], generator=gen), torch.randn(s["mlp"], generator=gen)
    with torch.inference_mode():
        F.scaled_dot_product_attention(q, k, v)
        F.linear(x, w, b)
        attention, linear = [], []
        for _ in range(reps):
            started = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v)
            attention.append((time.perf_counter() - started) * 1e3)
            started = time.perf_counter()
            for _ in range(10):
                F.linear(x, w, b)
            linear.append((time.perf_counter() - started) * 1e2)
    queue.put((statistics.median(attention), statistics.median(linear)))


def at_once(processes: int, reps: int) -> list[tuple[float, float]]:
    queue = mp.Queue()
    workers = [mp.Process(target=kernels, args=(reps, queue)) for _ in range(processes)]
    for w in workers:
        w.start()
    results = [queue.get() for _ in workers]
    for w in workers:
        w.join()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", help="JSON-lines file for the record (appended)")
    opts = parser.parse_args()
    rounds = []
    for index in range(opts.rounds):
        alone = at_once(1, opts.reps)[0]
        both = at_once(2, opts.reps)
        slower = [max(b[i] for b in both) / alone[i] for i in range(2)]
        rounds.append({"alone_ms": alone, "two_at_once_ms": both, "slowdown": slower})
        print(f"round {index + 1}: attention {alone[0]:.1f} ms alone, {', '.join(f'{b[0]:.1f}' for b in both)} ms two "
              f"at once ({slower[0]:.2f}x); linear {alone[1]:.2f} ms alone, {', '.join(f'{b[1]:.2f}' for b in both)} "
              f"ms two at once ({slower[1]:.2f}x)", flush=True)
    medians = [statistics.median(r["slowdown"][i] for r in rounds) for i in range(2)]
    print(f"median slowdown two at once: attention {medians[0]:.2f}x, linear {medians[1]:.2f}x; the best two ranks "
          f"can do: {2 / medians[0]:.2f}x (attention), {2 / medians[1]:.2f}x (linear)")
    if opts.out:
        with open(opts.out, "a") as f:
            f.write(json.dumps({"probe": "contention", "shapes": shapes(), "rounds": rounds,
                                "median_slowdown": {"attention": medians[0], "linear": medians[1]},
                                "load_avg_1m": os.getloadavg()[0],
                                "time": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
