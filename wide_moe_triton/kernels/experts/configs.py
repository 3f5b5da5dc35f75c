"""The experts' launch configs: the kernels' names in the tuning table, the defaults,
the spaces the tuner sweeps and the priors it always tries (per weight layout:
``tuning``), and the checks a config passes before a launch."""

from __future__ import annotations

import functools
from typing import NamedTuple

from .layout import ROW_BLOCK, staged_dot

KERNEL_UP = "experts_up"
KERNEL_DOWN = "experts_down"
# Defaults ("wgmma" and "nk" weights): the fastest measured on the H200 at TP8,
# b = 65..256 (NOTES: Weight layout).
DEFAULT_UP = {"BLOCK_M": 16, "BLOCK_N": 64, "A_BF16": 0, "num_warps": 4, "num_stages": 3,
              "maxnreg": 128}
DEFAULT_DOWN = {"BLOCK_M": 16, "BLOCK_N": 128, "A_BF16": 0, "num_warps": 4, "num_stages": 3,
                "maxnreg": 0}
# With the "wgmma_decode" layout (BF16 activations only) where the dot_scaled path runs
# it (off Hopper): the fastest the H200 measured at TP8, b = 65 and 256, on that path
# (NOTES: Exact decode instead of dot_scaled on Hopper; not measured off Hopper).
DEFAULT_UP_DECODE = {"BLOCK_M": 16, "BLOCK_N": 64, "A_BF16": 1, "num_warps": 4,
                     "num_stages": 3, "maxnreg": 128}
DEFAULT_DOWN_DECODE = {"BLOCK_M": 16, "BLOCK_N": 256, "A_BF16": 1, "num_warps": 8,
                       "num_stages": 3, "maxnreg": 128}
# Keys only the staged path (``staged_dot``) takes, with the values that leave a launch
# as it is without them (a config may omit them):
# - MASK_ROWS 1: a tile's rows past the expert's count are zeros rather than reads of
#   pair 0's activations; the copies stay asynchronous but cost instructions a step, so
#   it pays where tiles are mostly padding (b = 65-256 at TP8), not at b = 1024.
# - COLS (down launch only): column tiles a down program takes, their steps in one
#   pipelined loop (``_down_columns``); at TP8 a tile is only I / BLOCK_K = 3 steps.
# - HALF_TILE 1 (BLOCK_M >= 32): a list's last tile of at most BLOCK_M/2 pairs runs as
#   a BLOCK_M/2 tile (``_full_tiles``): for the 32-row tiles of b = 1024 at TP8.
# - TMA 1 (up launch only): the weight tiles and their scales are read by the tensor
#   memory accelerator (``_tma_weights``, ``_weight_descriptors``) instead of four
#   16-byte copies and their 64-bit addresses a thread a step. At b = 1024 those copies
#   drew a quarter of the loop's stall samples, each waiting to reuse the one register
#   pair its address is built in. Timed, it is 4% slower for the 32-pair tiles of
#   b = 1024 and within 4% either way for 16-pair ones, so it stays an opt-in key, in
#   no prior (NOTES: TMA weight loads).
STAGED_KEYS = {"MASK_ROWS": 0, "COLS": 1, "HALF_TILE": 0, "TMA": 0}
# The staged path's defaults: the fastest the H200 measured at TP8, b = 65 and 256:
# up + down 358 + 174 µs at b = 65, 522 + 252 at 256, against 409 + 247 and 542 + 377
# for DEFAULT_UP_DECODE / DEFAULT_DOWN_DECODE on the same path (NOTES: Column tiles in
# the down launch). The up launch's register cap is 128, not the 96 of those timings:
# with the register-operand wait (``_settled``) Triton 3.6 spills inside the loop at 96
# and waits for each of a step's 16 MMAs (NOTES: A model of the experts launches).
DEFAULT_UP_STAGED = {"BLOCK_M": 16, "BLOCK_N": 64, "A_BF16": 1, "num_warps": 4,
                     "num_stages": 3, "maxnreg": 128, "MASK_ROWS": 1}
DEFAULT_DOWN_STAGED = {"BLOCK_M": 16, "BLOCK_N": 128, "A_BF16": 1, "num_warps": 4,
                       "num_stages": 3, "maxnreg": 128, "MASK_ROWS": 1, "COLS": 4}
# BLOCK_K is deliberately absent: it fixes the reduction order, so it is a function of
# the shape only (``reduction_block``), never of the batch-width bucket.
# The up and the down launch share one space (each its own copy).
SPACE_UP = [{"BLOCK_M": m, "BLOCK_N": n, "A_BF16": a, "num_warps": w, "num_stages": s,
             "maxnreg": r}
            for m in (16, 32, 64) for n in (64, 128, 256) for a in (0, 1)
            for w in (4, 8) for s in (3, 4, 5) for r in (0, 128)]
SPACE_DOWN = [dict(c) for c in SPACE_UP]
# Configs the tuner always tries besides the default's neighbours: the best measured on
# the H200 at wide batches (several changes away from the default).
PRIORS_UP = [{"BLOCK_M": 32, "BLOCK_N": 128, "A_BF16": 0, "num_warps": 8, "num_stages": 3,
              "maxnreg": 128},
             # Deeper pipelines and wider tiles: more weight bytes in flight a program
             # (the engine reads 30% of DRAM bandwidth with the integer pipe half idle).
             {"BLOCK_M": 16, "BLOCK_N": 128, "A_BF16": 0, "num_warps": 4, "num_stages": 4,
              "maxnreg": 0},
             {"BLOCK_M": 16, "BLOCK_N": 128, "A_BF16": 0, "num_warps": 8, "num_stages": 4,
              "maxnreg": 128},
             {"BLOCK_M": 16, "BLOCK_N": 64, "A_BF16": 0, "num_warps": 4, "num_stages": 5,
              "maxnreg": 128}]
PRIORS_DOWN = [{"BLOCK_M": 32, "BLOCK_N": 256, "A_BF16": 0, "num_warps": 8, "num_stages": 3,
                "maxnreg": 128},
               {"BLOCK_M": 16, "BLOCK_N": 256, "A_BF16": 0, "num_warps": 8, "num_stages": 3,
                "maxnreg": 128},
               {"BLOCK_M": 16, "BLOCK_N": 256, "A_BF16": 0, "num_warps": 8, "num_stages": 4,
                "maxnreg": 128},
               {"BLOCK_M": 16, "BLOCK_N": 128, "A_BF16": 0, "num_warps": 4, "num_stages": 5,
                "maxnreg": 0}]
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "A_BF16", "num_warps", "num_stages", "maxnreg")


def config_rows(rows) -> list[dict]:
    """Launch configs from rows of values in CONFIG_KEYS order."""
    return [dict(zip(CONFIG_KEYS, row)) for row in rows]


# The "wgmma_decode" layout's priors: the fastest measured at b = 1024 (32-row tiles)
# and the runners-up at b = 65-256 (NOTES: Exact decode instead of dot_scaled on Hopper).
PRIORS_UP_DECODE = config_rows([(32, 128, 1, 8, 4, 128), (16, 128, 1, 8, 3, 128),
                                (16, 64, 1, 4, 4, 128)])
PRIORS_DOWN_DECODE = config_rows([(32, 256, 1, 8, 4, 128), (16, 256, 1, 8, 4, 128),
                                  (16, 128, 1, 4, 4, 128)])
# The staged path's: the fastest measured at b = 1024 (32-row tiles: the down one ending
# in a half tile, NOTES: Half tiles; the up one with masked rows too, which wins there
# with SiTU computed without division: 528 against 551 µs, NOTES: SiTU without
# division) and the runners-up at b = 65-256 (NOTES: Column tiles in the down launch).
# Then twice the rows on one warpgroup (up 128 hidden columns, down 256 latent ones),
# whose loops issue 5-14% fewer instructions a weight element: 16x128 uncapped is the
# tuner's pick at b = 64-256, 4% faster than 16x64 (NOTES: SiTU without division), while
# at b = 1024 all are 6-48% slower (NOTES: What limits the experts at b = 1024).
PRIORS_UP_STAGED = [dict(c, MASK_ROWS=m) for c, m in zip(config_rows(
    [(32, 64, 1, 4, 3, 168), (32, 64, 1, 4, 3, 168), (32, 128, 1, 8, 4, 128),
     (16, 64, 1, 4, 3, 128), (32, 128, 1, 4, 3, 168), (16, 128, 1, 4, 3, 168),
     (32, 128, 1, 4, 3, 0), (16, 128, 1, 4, 3, 0)]), (1, 0, 0, 1, 0, 1, 0, 1))]
# The down launch's first prior, the 32x128 half-tile one at maxnreg 168, is the fastest
# measured at b = 1024 with the accumulator zeroed where ptxas need not wait out each
# wgmma (``_down_columns``; NOTES: Column tiles in the down launch).
PRIORS_DOWN_STAGED = [dict(c, MASK_ROWS=m, COLS=k, HALF_TILE=h) for c, m, k, h in zip(
    config_rows([(32, 128, 1, 4, 3, 168), (32, 128, 1, 4, 3, 128), (32, 256, 1, 8, 3, 128),
                 (16, 256, 1, 8, 3, 128), (32, 256, 1, 4, 3, 168), (16, 256, 1, 4, 3, 168),
                 (32, 256, 1, 4, 3, 0)]),
    (1, 1, 1, 1, 1, 1, 1), (4, 4, 2, 2, 2, 2, 2), (1, 1, 0, 0, 1, 0, 1))]


class Tuning(NamedTuple):
    """What the sweep tries for one weight layout: the table key's suffix, the defaults,
    the spaces and the priors of the up and the down launch."""
    suffix: str
    default_up: dict
    default_down: dict
    space_up: list
    space_down: list
    priors_up: list
    priors_down: list


def tuning(layout: str, device) -> Tuning:
    """The sweep's configs for weights in ``layout`` on ``device``: "wgmma_decode" takes
    BF16 activations only, so its spaces are the others' configs with A_BF16 = 1; where
    it runs staged (``staged_dot``) they also range over STAGED_KEYS (and maxnreg 88 and
    96, and two stages).
    Built once per (layout, staged), shared: ``experts`` asks for it on every call."""
    return _tuning(layout, layout == "wgmma_decode" and staged_dot(device))


@functools.lru_cache(maxsize=None)
def _tuning(layout: str, staged: bool) -> Tuning:
    if layout != "wgmma_decode":
        return Tuning("", DEFAULT_UP, DEFAULT_DOWN, SPACE_UP, SPACE_DOWN, PRIORS_UP,
                      PRIORS_DOWN)
    bf16 = lambda configs: [c for c in configs if c["A_BF16"]]  # noqa: E731
    if not staged:
        return Tuning("_decode", DEFAULT_UP_DECODE, DEFAULT_DOWN_DECODE, bf16(SPACE_UP),
                      bf16(SPACE_DOWN), PRIORS_UP_DECODE, PRIORS_DOWN_DECODE)
    regs = [dict(c, maxnreg=r) for c in bf16(SPACE_UP) if c["maxnreg"]
            for r in (88, 96, 128)]
    regs += [c for c in bf16(SPACE_UP) if not c["maxnreg"]]
    # Two stages too: a 32-row up tile's three stages take 50 KB of shared memory, which
    # leaves room for four programs a SM where maxnreg 96 or 88 allows five.
    regs += [dict(c, num_stages=2) for c in regs if c["num_stages"] == 3]
    masked = [dict(c, MASK_ROWS=m) for c in regs for m in (0, 1)]
    masked += [dict(c, HALF_TILE=1) for c in masked if c["BLOCK_M"] >= 32]
    cols = [dict(c, COLS=k) for c in masked for k in (1, 2, 4)]
    # The sweep times only configs of its space: the priors join it where their register
    # cap is outside the grid above (maxnreg 168).
    return Tuning("_decode", DEFAULT_UP_STAGED, DEFAULT_DOWN_STAGED,
                  masked + [p for p in PRIORS_UP_STAGED if p not in masked],
                  cols + [p for p in PRIORS_DOWN_STAGED if p not in cols],
                  PRIORS_UP_STAGED, PRIORS_DOWN_STAGED)


def shape_key(latent: int, inter: int, num_experts: int) -> str:
    """Tuning key of both kernels: the dims that change their best config."""
    return f"L{latent}_I{inter}_E{num_experts}"



def _check_config(name: str, config: dict) -> dict:
    if not isinstance(config, dict):
        raise TypeError(f"{name} must be a dict of launch parameters, got "
                        f"{type(config).__name__}")
    if "BLOCK_K" in config:
        raise ValueError(f"{name} must not set BLOCK_K: the reduction step is fixed per "
                         f"shape, by prepare_weights, so that results never depend on the "
                         f"batch-width bucket")
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"{name} lacks {missing}")
    unknown = [k for k in config if k not in CONFIG_KEYS and k not in STAGED_KEYS]
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown} (known: "
                         f"{[*CONFIG_KEYS, *STAGED_KEYS]})")
    m, n = config["BLOCK_M"], config["BLOCK_N"]
    if m < 16 or m & (m - 1):
        raise ValueError(f"{name}['BLOCK_M'] must be a power of two >= 16, got {m}")
    if n < ROW_BLOCK or n & (n - 1):
        raise ValueError(f"{name}['BLOCK_N'] must be a power of two >= {ROW_BLOCK} (whole "
                         f"weight tiles), got {n}")
    if config["maxnreg"] not in (0, *range(24, 256, 8)):
        raise ValueError(f"{name}['maxnreg'] must be 0 (no cap) or a multiple of 8 in "
                         f"[24, 248], got {config['maxnreg']}")
    cols = config.get("COLS", 1)
    if not isinstance(cols, int) or cols < 1 or cols & (cols - 1):
        raise ValueError(f"{name}['COLS'] must be a power of two >= 1, got {cols!r}")
    if config.get("MASK_ROWS", 0) not in (0, 1):
        raise ValueError(f"{name}['MASK_ROWS'] must be 0 or 1, got {config['MASK_ROWS']!r}")
    if config.get("TMA", 0) not in (0, 1):
        raise ValueError(f"{name}['TMA'] must be 0 or 1, got {config['TMA']!r}")
    if config.get("HALF_TILE", 0) not in (0, 1):
        raise ValueError(f"{name}['HALF_TILE'] must be 0 or 1, got {config['HALF_TILE']!r}")
    if config.get("HALF_TILE", 0) and m < 32:
        raise ValueError(f"{name}['HALF_TILE'] needs BLOCK_M >= 32 (a half tile has at "
                         f"least 16 rows, the MMA's least), got BLOCK_M {m}")
    if config["A_BF16"] not in (0, 1):
        raise ValueError(f"{name}['A_BF16'] must be 0 or 1, got {config['A_BF16']}")
    return config


def _check_staged_keys(name: str, config: dict, staged: bool, up: bool) -> None:
    """STAGED_KEYS away from their neutral values only where a launch takes them."""
    set_keys = [k for k, v in STAGED_KEYS.items() if config.get(k, v) != v]
    if set_keys and not staged:
        raise ValueError(f"{name} sets {set_keys}, which only 'wgmma_decode' weights on "
                         f"Hopper take (experts.staged_dot)")
    if "COLS" in set_keys and up:
        raise ValueError(f"{name}['COLS'] is for the down launch only, got "
                         f"{config['COLS']}")
    if "TMA" in set_keys and not up:
        raise ValueError(f"{name}['TMA'] is for the up launch only, got {config['TMA']!r}")


def _check_decode_config(name: str, config: dict) -> None:
    # With BF16 weights and E4M3 activations, Triton 3.6 lowers dot_scaled with the
    # operands swapped and the weights through shared memory (no wgmma from registers):
    # the decoded layout is only worth it with BF16 activations.
    if not config["A_BF16"]:
        raise ValueError(f"{name}['A_BF16'] must be 1 with weights in the 'wgmma_decode' "
                         f"layout (their BF16 tile needs BF16 activations beside it)")


def _check_configs(config_up: dict, config_down: dict, decode: bool,
                   staged: bool) -> tuple[dict, dict]:
    """(config_up, config_down) checked as ``experts`` takes them for weights that run
    the decode layout (``decode``) and the staged path (``staged``), or a named error."""
    cfg_up = _check_config("config_up", config_up)
    cfg_down = _check_config("config_down", config_down)
    if decode:
        _check_decode_config("config_up", cfg_up)
        _check_decode_config("config_down", cfg_down)
    _check_staged_keys("config_up", cfg_up, staged, up=True)
    _check_staged_keys("config_down", cfg_down, staged, up=False)
    return cfg_up, cfg_down

