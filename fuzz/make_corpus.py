#!/usr/bin/env python3
"""make_corpus.py: writes the seed corpus of fuzz_api (fuzz/corpus/seed-NN), deterministic.

Input format (fuzz/fuzz_api.c): byte 0 = config (block size 4/1/3/16 in bits 0-1, dtypes,
layers in bit 7), byte 1 = pool size, byte 2 = prompt set (0xff: prefix cache off; bit 2:
attention in pool order; bit 3: a host tier, whose saves and loads are ops 15 and 16; bit 4: the
tier's thread, prefetching and writing back; bit 5: files, not host memory; bit 6: context shifts,
the op after all others: 15, or 17 with a tier), then the call script read by pm_step (op byte, then its operand
bytes). Each seed covers one config with a script biased towards one theme (matches, eviction
pressure, forks/truncates, pins, attention over them). The corpus's regress-NN files are
not written here: each is an input a fuzz run once failed on, kept as found (minimized)."""
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")
# pm_step op numbers (enum in prefix_model.h)
MATCH, CREATE, APPEND, COMMIT, FORK, TRUNC, RELEASE, PIN, UNPIN, NEG, REWRITE, MATCH2, ATTN, COMPACT, DROP = range(15)
TIER_SAVE, TIER_LOAD = 15, 16  # with byte 2's bit 3 only
SHIFT = -1  # with byte 2's bit 6: 15, or 17 where a tier's ops come first
THEMES = {
    "match": [MATCH, MATCH2, CREATE, RELEASE, MATCH, COMMIT],
    "evict": [CREATE, APPEND, APPEND, RELEASE, MATCH, MATCH2],
    "fork": [MATCH, FORK, TRUNC, APPEND, COMMIT, REWRITE, RELEASE],
    "pin": [MATCH, PIN, RELEASE, UNPIN, APPEND, MATCH2],
    "mixed": list(range(13)),
    "attn": [MATCH, APPEND, FORK, ATTN, TRUNC, ATTN, RELEASE, MATCH2, ATTN],
    # dropped fronts (prefix cache off): attention, trees, truncates and pins over them
    "drop": [CREATE, APPEND, APPEND, DROP, ATTN, FORK, DROP, ATTN, TRUNC, PIN, REWRITE, COMPACT, ATTN],
    # a host tier: saves and loads (plain, windowed, after matches) among drops, forks, evictions
    "tier": [CREATE, APPEND, TIER_SAVE, TIER_LOAD, MATCH, RELEASE, DROP, TIER_SAVE, TIER_LOAD, FORK, ATTN, MATCH2],
    # context shifts among appends, commits, forks, matches, pins and attention (k >= 2: with a tier's saves)
    "shift": [CREATE, APPEND, SHIFT, MATCH, FORK, SHIFT, COMMIT, TRUNC, ATTN, SHIFT, PIN, MATCH2, APPEND, TIER_SAVE],
}


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = random.Random(20261122)
    configs = [0x00, 0x01, 0x02, 0x03, 0x04, 0x84, 0x88, 0x13, 0x8f, 0x16]
    n = 0
    for theme, ops in THEMES.items():
        for k in range(4):
            cfg = configs[(n + k) % len(configs)]
            pool = rng.randrange(256)
            b2 = 0xFF if (theme == "mixed" and k == 3) or theme == "drop" else rng.randrange(4)
            if theme == "attn" and k % 2:
                b2 |= 4  # attention in pool order
            if theme == "tier":
                b2 |= 8 | (16 if k % 2 else 0) | (32 if k >= 2 else 0)  # odd: its thread; 2, 3: files
            if theme == "shift":
                b2 |= 64 | (8 if k >= 2 else 0)
            data = bytearray([cfg, pool, b2])
            for _ in range(rng.randrange(40, 90)):
                op = rng.choice(ops)
                if op == SHIFT:
                    op = 17 if b2 & 8 else 15
                elif theme == "shift" and op == TIER_SAVE and not b2 & 8:
                    op = APPEND
                data.append(op)
                data.extend(rng.randrange(256) for _ in range(6))  # operands: any bytes decode
            with open(os.path.join(OUT, "seed-%02d-%s" % (n, theme)), "wb") as f:
                f.write(bytes(data))
            n += 1


if __name__ == "__main__":
    main()
