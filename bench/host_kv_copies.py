"""The host tier's copies (engine/host_kv_store.py) against copying each block layer by layer,
as the tier first did on CUDA: the same saves and loads, same pool, same process, timed by this
process's CPU time with one thread (on a GPU, the check `host_kv_8b` times them against a
prefill).

The pool has the bench model's shape by default (12 layers of 4 KV heads of 64, float32, blocks
of 16 tokens); a run saves --blocks blocks to host slots and loads as many back into other
blocks, best of --repeats.

    .venv/bin/python bench/host_kv_copies.py
    .venv/bin/python bench/host_kv_copies.py --layers 32 --kv-heads 8 --head-dim 128
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import torch

from phasefleet.engine.host_kv_store import HostKVStore
from phasefleet.engine.host_prefix_cache import KVMove


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


def layer_by_layer(
    store: HostKVStore, pool: list[tuple[torch.Tensor, torch.Tensor]]
) -> Callable[[list[KVMove]], None]:
    """The baseline: one copy per block, layer and kind (keys, values)."""
    slots = store.slots[0]

    def apply(moves: list[KVMove]) -> None:
        for m in moves:
            for layer, pair in enumerate(pool):
                for which, cache in enumerate(pair):
                    if m.to_host:
                        slots[m.slot, layer, which].copy_(cache[m.block_id])
                    else:
                        cache[m.block_id].copy_(slots[m.slot, layer, which])

    return apply


def best_cpu_s(apply: Callable[[list[KVMove]], None], moves: list[KVMove], repeats: int) -> float:
    apply(moves)  # untimed: the first touch of the pages
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        apply(moves)
        best = min(best, time.process_time() - started)
    return best


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    n = args.blocks
    shape = (2 * n + 1, 16, args.kv_heads, args.head_dim)
    pool = [(torch.randn(shape), torch.randn(shape)) for _ in range(args.layers)]
    store = HostKVStore([pool], [(pool, 0)], num_slots=n)
    moves = [KVMove(1 + k, k, True) for k in range(n)] + [
        KVMove(n + 1 + k, k, False) for k in range(n)
    ]
    mib = n * store.slots[0][0].numel() * 4 / 2**20
    staged = best_cpu_s(store.apply, moves, args.repeats)
    baseline = best_cpu_s(layer_by_layer(store, pool), moves, args.repeats)
    print(
        f"machine: {platform.processor() or platform.machine()}, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}, one thread, CPU time\n"
        f"{n} blocks saved and {n} loaded ({mib:.0f} MiB each way; {args.layers} layers, "
        f"{args.kv_heads} KV heads of {args.head_dim}, float32)\n"
        f"staged (a gather a layer, a copy a block): {staged * 1000:.1f} ms\n"
        f"a copy per block, layer and kind: {baseline * 1000:.1f} ms\n"
        f"staged is {baseline / staged:.2f}x as fast"
    )


if __name__ == "__main__":
    main()
