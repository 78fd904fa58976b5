"""Secure aggregation's compute cost at model scale: mask generation, ring sums and unmasking.

    python benchmarks/secagg.py                      # 100M parameters, N = 4 and 8, 2^16 ring
    python benchmarks/secagg.py --params 10e6 --quick
    python benchmarks/secagg.py --bits 32 --degree 4

Everything runs in this process, on one core (--threads, --workers), with the real code of `fedtrain.privacy` (no
network: the wire cost is the ring's bytes per parameter, printed beside). Each figure is the
best of --repeat runs, in seconds. Rows:

  stream         ChaCha20 keystream for the whole model, one seed (GB/s beside)
  ring add       one whole-model ring addition (numpy uint16/uint32, wraps by definition)
  encode         clip, weight and round the float32 update into the ring
  participant    encode + self mask + k pairwise masks (k = N − 1, or --degree)
  ... ahead      the same with the masks drawn during the inner steps (SecAggParticipant.precompute)
  coord. sum     fold N masked uploads into the ring sums
  coord. unmask  rebuild N self seeds from shares, remove N self masks, decode to float32
  + 1 dropout    the extra work when one participant drops after masking (its k pairwise masks)

Participants mask in parallel with one another, and their masks do not depend on the update:
they could be drawn during the inner steps, once keys are agreed. The coordinator's sum runs as
uploads arrive; only its unmasking sits after the last upload.
"""

from __future__ import annotations

import argparse
import secrets
import time
from collections.abc import Callable

import torch

from fedtrain.privacy.keys import ParticipantKeys, RoundTag
from fedtrain.privacy.masks import PAIR, SELF, mask_stream, mask_tensor
from fedtrain.privacy.ring import FixedPoint, ring_add
from fedtrain.privacy.shamir import combine, split
from fedtrain.privacy.unmask import Recovered, unmask_tensor


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def tensors(params: int, count: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    size = params // count
    return {f"layer.{i}": torch.randn(size, generator=g) * 0.01 for i in range(count)}


def run(
    params: int, count: int, n: int, degree: int | None, bits: int, repeat: int, workers: int
) -> list[tuple[str, float, str]]:
    fp = FixedPoint.plan(n, clip=0.1, bits=bits)
    k = n - 1 if degree is None else min(degree, n - 1)
    update = tensors(params, count)
    numel = sum(t.numel() for t in update.values())
    names = list(update)
    self_seed = secrets.token_bytes(32)
    pair_seeds = {v: secrets.token_bytes(32) for v in range(2, 2 + k)}
    nbytes = numel * fp.bytes_per_value

    rows: list[tuple[str, float, str]] = []
    mask_stream(self_seed, PAIR, "warm-up", numel, bits)  # first-touch page faults, not ChaCha20
    t = best(lambda: [mask_stream(self_seed, PAIR, nm, update[nm].numel(), bits) for nm in names], repeat)
    rows.append(("stream (one seed)", t, f"{nbytes / t / 1e9:.2f} GB/s"))
    a = [fp.zeros(update[nm].numel()) for nm in names]
    b = [mask_stream(self_seed, SELF, nm, update[nm].numel(), bits) for nm in names]
    t = best(lambda: [ring_add(x, y) for x, y in zip(a, b, strict=True)], repeat)
    rows.append(("ring add (one upload)", t, f"{nbytes / t / 1e9:.2f} GB/s"))
    t = best(lambda: [fp.encode(update[nm], 1 / n) for nm in names], repeat)
    rows.append(("encode", t, ""))

    def participant() -> list[object]:
        return [mask_tensor(fp.encode(update[nm], 1 / n), nm, 1, self_seed, pair_seeds, fp, workers) for nm in names]

    t_part = best(participant, repeat)
    rows.append((f"participant: encode + 1 + {k} masks", t_part, ""))
    uploads = participant()
    premasks = participant()  # a net mask per tensor, as SecAggParticipant.precompute holds them

    def participant_ahead() -> list[object]:
        out = []
        for nm, premask in zip(names, premasks, strict=True):
            e = fp.encode(update[nm], 1 / n)
            ring_add(e, premask)
            out.append(e)
        return out

    t_ahead = best(participant_ahead, repeat)
    rows.append(("participant, masks drawn ahead: encode + 1 add", t_ahead, "after the inner steps"))

    def coord_sum() -> list[object]:
        sums = [fp.zeros(update[nm].numel()) for nm in names]
        for _ in range(n):
            for acc, up in zip(sums, uploads, strict=True):
                ring_add(acc, up)  # type: ignore[arg-type]
        return sums

    t_sum = best(coord_sum, repeat)
    rows.append((f"coordinator: sum of {n} uploads", t_sum, "as they arrive"))
    seeds = {u: secrets.token_bytes(32) for u in range(1, n + 1)}
    shares = {u: split(s, range(1, n + 1), n // 2 + 1) for u, s in seeds.items()}

    def coord_unmask(dropped_pairs: dict[tuple[int, int], bytes]) -> None:
        rebuilt = {u: combine(list(sh.values())[: n // 2 + 1], n // 2 + 1) for u, sh in shares.items()}
        rec = Recovered(rebuilt, dropped_pairs)
        for nm in names:
            acc = fp.zeros(update[nm].numel())
            fp.decode(unmask_tensor(acc, nm, rec, fp, workers))

    t_unmask = best(lambda: coord_unmask({}), repeat)
    rows.append((f"coordinator: unmask {n} self masks + decode", t_unmask, "after the last upload"))
    dropped = {(u, n + 1): secrets.token_bytes(32) for u in range(1, k + 1)}
    t_drop = best(lambda: coord_unmask(dropped), repeat)
    rows.append(("coordinator: same, one dropout", t_drop, f"+{t_drop - t_unmask:.2f} s"))

    keys = [ParticipantKeys.generate(u) for u in (1, 2)]
    tag = RoundTag("bench", 1)
    t_keys = best(lambda: keys[0].pair_seed(tag, 2, keys[1].public()), repeat)
    rows.append(("key agreement (one pair)", t_keys, ""))
    t_shamir = best(lambda: combine(list(split(self_seed, range(1, n + 1), n // 2 + 1).values()), n // 2 + 1), repeat)
    rows.append((f"Shamir split + combine (n = {n})", t_shamir, ""))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--tensors", type=int, default=4, help="the model is split into this many tensors")
    parser.add_argument("--n", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--degree", type=int, default=None, help="SecAgg+ neighbours (default: everyone)")
    parser.add_argument("--bits", type=int, default=16, choices=[16, 32])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default one core)")
    parser.add_argument("--workers", type=int, default=1, help="threads that draw one tensor's masks")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeat = 1 if args.quick else args.repeat
    params = int(args.params)
    print(f"secure aggregation, {params / 1e6:.0f}M parameters in {args.tensors} tensors, 2^{args.bits} ring "
          f"({args.bits // 8} bytes/parameter on the wire; fp32 4, int8 ~1.02), best of {repeat}, torch threads "
          f"{torch.get_num_threads()}, mask workers {args.workers}")
    for n in args.n:
        print(f"\nN = {n}" + (f", degree {args.degree}" if args.degree else ", full pairing"))
        print("| step | s | note |\n|---|---|---|")
        for name, seconds, note in run(params, args.tensors, n, args.degree, args.bits, repeat, args.workers):
            print(f"| {name} | {seconds:.4f} | {note} |")


if __name__ == "__main__":
    main()
