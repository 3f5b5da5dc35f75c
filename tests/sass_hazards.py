"""Writes to the register operand of Hopper's asynchronous MMA before it has completed,
found in a compiled kernel's SASS.

``wgmma.mma_async`` (SASS ``HGMMA``) may take its A operand from registers and read them
after it issues; writing those registers before a ``wgmma.wait_group`` that covers the
MMA is undefined in the PTX ISA (section "wgmma.wait_group"), and on the H200 the MMA
then multiplies some of the new values: results that depend on timing (seen on the H200:
benchmarks/NOTES.md, "Register-operand wait"). Triton 3.6's software pipeliner can emit
such code for a loop whose MMAs take the A operand from registers: it waits for all but
the last group of the step, and the next step's instructions overwrite the registers of
the groups still in flight (reported as triton-lang/triton#9433).

In SASS an MMA group is the ``HGMMA`` instructions up to one marked ``gsb0``;
``WARPGROUP.DEPBAR.LE gsb0, N`` returns once at most N groups are in flight. A hazard is
an instruction whose destination register is an A operand of a group that may still be
in flight there: in the kernel's straight-line order, and around each loop that holds an
MMA (its body twice over, so that the groups still in flight at the end of an iteration
meet the writes at the start of the next).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import NamedTuple

import triton

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")
_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")
_MMA = re.compile(r"HGMMA\S*\s+R\d+,\s*R(\d+),")
_WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)")
_BRANCH = re.compile(r"BRA\s+0x([0-9a-f]+)")
# Opcodes whose first operand is not a register they write.
_NO_DESTINATION = {"ST", "STS", "STG", "STL", "STSM", "RED", "REDG", "ATOMS", "BAR", "BRA",
                   "EXIT", "RET", "CALL", "LDGSTS", "DEPBAR", "LDGDEPBAR", "WARPGROUP",
                   "WARPSYNC", "MEMBAR", "FENCE", "CCTL", "SYNCS", "NOP", "UTMALDG",
                   "UTMASTG", "UBLKCP", "ARRIVES", "HGMMA", "BSSY", "BSYNC", "YIELD", "ERRBAR"}
A_REGISTERS = 4  # an A fragment of one HGMMA: 4 registers a thread (64 x 16 BF16 or 64 x 32 FP8)


class Hazard(NamedTuple):
    mma: str      # the MMA whose A operand is overwritten
    writer: str   # the instruction that writes it
    where: str    # "straight" or "loop at 0x..."


def sass_of(cubin: bytes) -> str:
    """The SASS of a cubin, by the cuobjdump that ships with Triton."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        done = subprocess.run([CUOBJDUMP, "--dump-sass", path], capture_output=True,
                              text=True, check=True)
    return done.stdout


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of each SASS line, the alignment NOPs left out."""
    out = []
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m and m.group(2) != "NOP":
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def written_registers(instruction: str) -> set[int]:
    """The general registers an instruction writes: its first operand, widened by a
    .64 / .WIDE (2) or .128 (4) suffix; none for stores, branches, barriers and MMAs."""
    instruction = _PREDICATE.sub("", instruction)
    parts = instruction.split(None, 1)
    if len(parts) < 2:
        return set()
    opcode, operands = parts
    pieces = opcode.split(".")
    if pieces[0] in _NO_DESTINATION:
        return set()
    m = re.fullmatch(r"R(\d+)", operands.split(",")[0].strip())
    if not m:
        return set()
    width = 4 if "128" in pieces else 2 if ("64" in pieces or "WIDE" in pieces) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def hazards_in(stream: list[str], where: str) -> list[Hazard]:
    """The hazards of one instruction sequence, no MMA in flight at its start."""
    found, in_flight, group, group_mmas = [], [], set(), []
    for ins in stream:
        ins = _PREDICATE.sub("", ins)
        mma = _MMA.match(ins)
        if ins.startswith("HGMMA"):
            if mma:
                group |= set(range(int(mma.group(1)), int(mma.group(1)) + A_REGISTERS))
                group_mmas.append(ins)
            if "gsb0" in ins:
                in_flight.append((group, group_mmas))
                group, group_mmas = set(), []
            continue
        wait = _WAIT.match(ins)
        if wait:
            keep = int(wait.group(1), 16)
            in_flight = in_flight[len(in_flight) - keep:] if keep else []
            continue
        written = written_registers(ins)
        for regs, mmas in in_flight + [(group, group_mmas)]:
            if written & regs:
                found.append(Hazard(mmas[0], ins, where))
                break
    return found


def mma_loops(insts: list[tuple[int, str]]) -> list[tuple[int, list[str]]]:
    """(start address, body) of each loop (a backward branch) whose body holds an MMA."""
    loops = []
    for address, ins in insts:
        m = _BRANCH.search(ins)
        if m and int(m.group(1), 16) <= address:
            start = int(m.group(1), 16)
            body = [x for a, x in insts if start <= a <= address]
            if any("HGMMA" in x for x in body):
                loops.append((start, body))
    return loops


def kernel_hazards(sass: str) -> tuple[list[Hazard], int, int]:
    """(hazards, MMAs with a register A operand, loops holding an MMA) of a kernel's SASS."""
    insts = instructions(sass)
    found = hazards_in([x for _, x in insts], "straight")
    loops = mma_loops(insts)
    for start, body in loops:
        found += hazards_in(body + body, f"loop at {start:#x}")
    register_mmas = sum(1 for _, x in insts if _MMA.match(_PREDICATE.sub("", x)))
    return found, register_mmas, len(loops)
