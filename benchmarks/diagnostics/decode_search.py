"""Is there a "wgmma_decode" word code that decodes in fewer than 9 operations a word?

    python benchmarks/diagnostics/decode_search.py

The decode turns a 32-bit word of 8 E2M1 codes into 4 BF16 pairs whose set bits may
only be the fields {15, 8, 7, 6} of each half (sign, two exponent bits, one mantissa
bit: ``layout.BF16_PAIR_FIELDS``). One pair is the word masked (1 operation); every
other pair is some transform of the word, then the mask (2 operations), unless its
bits come from two transforms (4: two shifts, a select, a mask), as the shipped code's
fourth pair does (9 a word in all). A code whose four pairs each need at most two
operations exists only if the transforms' preimages of the mask tile the word's bits
exactly. This searches that exactly, for one word and for two words decoded together
(a funnel shift of the two then reaches across them), with every rotation, logical
shift, funnel shift and byte permute (``PRMT``) of the words, and with a pair that takes
its top bit from ``word << 31`` (3 operations). It prints each cover it finds, or that
none exists. No GPU and no Triton needed."""

from __future__ import annotations

import itertools

FIELDS = (6, 7, 8, 15, 22, 23, 24, 31)   # the set bits a BF16 pair of the decode may hold
WORD = 32


def preimage(source) -> frozenset:
    """The source bits a transform brings to the fields (source(i): the bit that lands
    at bit i, or None where the transform shifts in zeros)."""
    bits = [source(i) for i in FIELDS]
    return frozenset(bits) if None not in bits else frozenset()


def word_transforms(word: int) -> list[tuple[int, str, frozenset]]:
    """(operations, name, preimage) of each transform of one word (bits word*32 ..)."""
    base = word * WORD
    name = "ab"[word]
    out = [(1, f"{name} & mask", preimage(lambda i: base + i))]
    for r in range(1, WORD):
        out.append((2, f"rot({name}, {r})", preimage(lambda i: base + (i + r) % WORD)))
        out.append((2, f"{name} >> {r}",
                    preimage(lambda i: base + i + r if i + r < WORD else None)))
        out.append((2, f"{name} << {r}",
                    preimage(lambda i: base + i - r if i - r >= 0 else None)))
    for perm in itertools.product(range(4), repeat=4):   # PRMT: output byte j <- byte perm[j]
        out.append((2, f"prmt({name}, {perm})",
                    preimage(lambda i: base + 8 * perm[i // 8] + i % 8)))
    # the top bit of the pair from `word << 31` (its bit 0), the other seven rotated
    for r in range(WORD):
        bits = [base + (i + r) % WORD for i in FIELDS[:-1]] + [base]
        if len(set(bits)) == len(FIELDS):
            out.append((3, f"rot({name}, {r}) | {name} << 31", frozenset(bits)))
    return out


def shipped_fourth_pair() -> tuple[int, str, frozenset]:
    """The shipped code's fourth pair (``tiles._bf16_pairs``' p3): fields 6, 7, 15, 22,
    23, 31 from ``w << 2`` and 8, 24 from ``w >> 6``, 4 operations."""
    return (4, "(a << 2) & .. | (a >> 6) & ..",
            frozenset(i - 2 if i not in (8, 24) else i + 6 for i in FIELDS))


def funnel_transforms() -> list[tuple[int, str, frozenset]]:
    """Funnel shifts of the two words (hi:lo) >> s, then the mask."""
    out = []
    for hi, lo in ((0, 1), (1, 0)):
        for s in range(1, WORD):
            def source(i, s=s, hi=hi, lo=lo):
                j = i + s
                return lo * WORD + j if j < WORD else hi * WORD + j - WORD
            out.append((2, f"funnel({'ab'[hi]}:{'ab'[lo]}, {s})", preimage(source)))
    return out


def covers(words: int, transforms, budget: int):
    """Each set of 4 * words transforms whose preimages tile the words' bits, costing
    fewer than ``budget`` operations."""
    # one transform a preimage, the cheapest (an identity PRMT is the mask's preimage too)
    transforms = list({t[2]: t for t in sorted(transforms, reverse=True) if t[2]}.values())
    every = frozenset(range(words * WORD))
    holding = {b: [t for t in transforms if b in t[2]] for b in every}
    found = []

    def search(covered, chosen, cost):
        if cost >= budget:
            return
        if covered == every:
            found.append((cost, [t[1] for t in chosen]))
            return
        lowest = min(every - covered)
        for t in holding[lowest]:
            if not t[2] & covered:
                chosen.append(t)
                search(covered | t[2], chosen, cost + t[0])
                chosen.pop()

    search(frozenset(), [], 0)
    return found


def main() -> None:
    # The search itself, checked: with the shipped fourth pair allowed it finds 9.
    shipped = covers(1, word_transforms(0) + [shipped_fourth_pair()], 10)
    print(f"the shipped code's kind, 9 operations a word: found {len(shipped)} "
          f"(e.g. {min(shipped)[1] if shipped else None})")
    one = word_transforms(0)
    two = one + word_transforms(1) + funnel_transforms()
    for label, words, transforms in (("one word", 1, one), ("two words", 2, two)):
        found = covers(words, transforms, 9 * words)
        print(f"{label}: {len(transforms)} transforms, covers under {9 * words} operations: "
              f"{len(found)}")
        for cost, names in sorted(found)[:5]:
            print(f"  {cost}: {names}")


if __name__ == "__main__":
    main()
