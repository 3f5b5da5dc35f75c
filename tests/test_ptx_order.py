"""The mailbox's order across GPUs (docs/design.md, "Memory ordering of the mailbox")
rests on what the compiler emits, so it is checked in the PTX of every kernel that
publishes, polls or re-arms, compiled for sm_90 with no GPU (as ``test_compile.py``
compiles: launches recorded in the interpreter, compiled in a subprocess without
TRITON_INTERPRET):

- each poll's loads are strong at system scope (``ld.volatile``, which PTX treats as
  ``ld.relaxed.sys``), and the poll's re-read sits in a loop (a branch back over it), so
  a round cannot be hoisted out of the loop or served from an earlier read;
- a logits word (FP32 bits) is polled and published whole, 32 bits or more an element,
  so a half-written word can never pass for a published one;
- each kernel re-arms behind a CTA barrier, and the publish stores are plain global
  stores, one instruction a word and destination, with no fence the argument needs;
- no kernel that publishes, polls or re-arms takes part in a programmatic dependent
  launch (``griddepcontrol``), and the one dependent launch (finalize after the experts'
  down kernel) touches no mailbox word: every re-arm and the next publication of its
  word stay a full kernel boundary apart.
"""
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch
from triton.runtime import interpreter

from conftest import DEVICE
from test_compile import launch_spec
from wide_moe_triton import LatentMoE, SimulatedGroup, WideMoEConfig
from wide_moe_triton.kernels import finalize as finalize_k
from wide_moe_triton.kernels import mailbox as mb
from wide_moe_triton.kernels import plan as plan_k
from wide_moe_triton.kernels import route as route_k

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="records its launches in Triton's interpreter"),
              pytest.mark.slow]  # compiles (about 15 s)

ROUTE_ONLY = "_route_kernel without the plan"
POLLING = ("_route_kernel", ROUTE_ONLY, "_plan_mailbox_kernel", "_all_reduce_rms_norm_kernel",
           "_all_reduce_kernel")
PUBLISHING = ("_publish_kernel", "_publish_partial_kernel")
STRONG_LOAD = re.compile(r"\bld\.(volatile|relaxed\.sys|acquire\.sys)\.global\b")
BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")
LABEL = re.compile(r"^(\$L__\w+):")
LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s")
FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')
# The element width of a load or store: .b32, .v4.b32, .u16, ...
WIDTH = re.compile(r"\.(?:b|u|s|f)(8|16|32|64|128)\b")


class Instruction(NamedTuple):
    """One PTX instruction: its text, and the source file and line of the ``.loc`` before
    it (the innermost of an inlined call)."""

    text: str
    file: str
    line: int


class Ptx(NamedTuple):
    instructions: list[Instruction]
    labels: dict[str, int]   # label -> index of the instruction that follows it


def parse(ptx: str) -> Ptx:
    files = {m.group(1): pathlib.Path(m.group(2)).name
             for m in map(FILE.match, ptx.splitlines()) if m}
    instructions, labels = [], {}
    where, in_asm, asm_where = ("", 0), False, None
    for raw in ptx.splitlines():
        line = raw.split("//")[0].strip()
        loc, label = LOC.match(raw), LABEL.match(line)
        if "begin inline asm" in raw or "end inline asm" in raw:
            in_asm, asm_where = "begin" in raw, None
        elif loc:
            # Triton's vector loads and stores (inline asm) step the line of their .loc
            # once an element: the block's first .loc is the statement's.
            if not in_asm or asm_where is None:
                where = (files.get(loc.group(1), ""), int(loc.group(2)))
                asm_where = where if in_asm else None
        elif label:
            labels[label.group(1)] = len(instructions)
        elif line and not line.startswith("."):
            instructions.append(Instruction(line, *where))
    return Ptx(instructions, labels)


def in_loop(ptx: Ptx, index: int) -> bool:
    """Whether a branch after instruction ``index`` jumps back to a label at or before it."""
    return any(ptx.labels.get(m.group(1), len(ptx.instructions)) <= index
               for i in range(index + 1, len(ptx.instructions))
               if (m := BRANCH.search(ptx.instructions[i].text)))


def source_line(fn, text: str) -> tuple[str, int]:
    """(file name, line) of the one line of ``fn``'s source (a jit function) holding
    ``text``."""
    fn = getattr(fn, "fn", fn)
    lines, first = inspect.getsourcelines(fn)
    found = [first + i for i, line in enumerate(lines) if text in line]
    assert len(found) == 1, f"{text!r} stands {len(found)} times in {fn.__name__}"
    return pathlib.Path(inspect.getsourcefile(fn)).name, found[0]


def at(ptx: Ptx, where: tuple[str, int], op: str) -> list[int]:
    """Indices of the instructions of kind ``op`` ("ld", "st", "bar") from source line
    ``where``; loads and stores only where they reach global memory (not the shared
    memory a layout conversion passes through, nor kernel parameters)."""
    return [i for i, ins in enumerate(ptx.instructions)
            if (ins.file, ins.line) == where and re.search(rf"(^|\s){op}\.", ins.text)
            and not re.search(r"\.(shared|param|local)\b", ins.text)]


def width(text: str) -> int:
    m = WIDTH.search(text)
    return int(m.group(1)) if m else 0


# ----------------------------------------------------------------------------- checks
# Each returns the problems found in one kernel's PTX (empty: it holds).

POLL_FIRST = source_line(mb.poll, "values = tl.load(")
POLL_AGAIN = source_line(mb.poll, "again = tl.load(")
REARM_BARRIER = source_line(mb.rearm, "tl.debug_barrier()")
REARM_STORE = source_line(mb.rearm, "tl.store(")
ROUTE_REREAD = source_line(route_k.take_candidates, "volatile=POLLED")
PUBLISH_WORD = source_line(mb._publish_kernel, "tl.pointer_type(tl.int32)) + word_at")
PUBLISH_HALF = source_line(mb._publish_kernel, "tl.pointer_type(tl.int16)) + half_at")
PUBLISH_PARTIAL = source_line(mb._publish_partial_kernel, "tl.store(")


def poll_problems(ptx: Ptx) -> list[str]:
    """The poll's loads: present, strong at system scope, the re-read inside a loop."""
    first, again = at(ptx, POLL_FIRST, "ld"), at(ptx, POLL_AGAIN, "ld")
    problems = [f"no load from mailbox.py:{w[1]}" for w, found in
                ((POLL_FIRST, first), (POLL_AGAIN, again)) if not found]
    problems += [f"a poll load is not strong at system scope: {ptx.instructions[i].text}"
                 for i in first + again if not STRONG_LOAD.search(ptx.instructions[i].text)]
    problems += [f"a poll's re-read is in no loop: {ptx.instructions[i].text}"
                 for i in again if not in_loop(ptx, i)]
    return problems


def rearm_problems(ptx: Ptx) -> list[str]:
    """The re-arm: a CTA barrier (every thread has read its words), then plain global
    stores of the sentinel."""
    stores, barriers = at(ptx, REARM_STORE, "st"), at(ptx, REARM_BARRIER, "bar")
    problems = [] if stores else ["no re-arm store"]
    problems += [] if barriers else ["no barrier before the re-arm"]
    problems += [f"a re-arm store is not a global store: {ptx.instructions[i].text}"
                 for i in stores if ".global" not in ptx.instructions[i].text]
    return problems


def whole_word_problems(ptx: Ptx, lines, op: str) -> list[str]:
    """Every ``op`` ("ld" or "st") from ``lines`` moves elements of 32 bits or more: an
    FP32 word is never split in two halves that could be seen apart."""
    found = [i for where in lines for i in at(ptx, where, op)]
    problems = [] if found else [f"no {op} from the logits lines"]
    return problems + [f"a logits {op} of {width(ptx.instructions[i].text)}-bit elements: "
                       f"{ptx.instructions[i].text}" for i in found
                       if width(ptx.instructions[i].text) < 32]


def publish_problems(ptx: Ptx, lines) -> list[str]:
    """Publication: plain global stores, inside the loop over destinations (one store a
    word and peer, none merged away)."""
    found = [i for where in lines for i in at(ptx, where, "st")]
    problems = [] if found else ["no publish store"]
    problems += [f"a publish store is not a global store: {ptx.instructions[i].text}"
                 for i in found if ".global" not in ptx.instructions[i].text]
    return problems + [f"a publish store is in no loop over the peers: "
                       f"{ptx.instructions[i].text}" for i in found if not in_loop(ptx, i)]


def dependent_launch_problems(ptx: Ptx) -> list[str]:
    return [f"a dependent-launch control: {ins.text}" for ins in ptx.instructions
            if "griddepcontrol" in ins.text]


# ----------------------------------------------------------------------------- the PTX

def run_mailbox_workload():
    """Two simulated ranks at tiny dims (publish, the route with the plan polled from the
    mailbox, both tail all-reduces), and the plan and the route polled on their own."""
    cfg = WideMoEConfig.tiny(wide_rows=16)
    stock = LatentMoE(cfg, seed=0, device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    SimulatedGroup(stock, 2)(torch.randn(2, cfg.hidden, generator=gen).bfloat16())
    latent, experts, wide_rows, rows = 64, 16, 8, 3
    box = mb.empty_mailbox((wide_rows, latent, experts), DEVICE)
    generation = torch.zeros(1, dtype=torch.int32)
    front = torch.randn(rows, experts + latent, generator=gen)
    mb.publish(front, mb.mailbox_table([box]), 0, 1, generation, latent, experts,
               wide_rows=wide_rows)
    plan_k.quantize_mxfp8_mailbox(box, generation, rows, latent=latent, world=1,
                                  error=mb.new_error_record(DEVICE))
    route_k.route_mailbox(box, generation, rows, torch.zeros(experts), 2, True, 1.0,
                          latent=latent, world=1, error=mb.new_error_record(DEVICE))


COMPILE = """import json, sys
from compile_specs import compile_spec
specs = json.load(open(sys.argv[1]))
json.dump({k: compile_spec(s, 90).asm["ptx"] for k, s in specs.items()}, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> dict[str, Ptx]:
    """Each mailbox kernel's sm_90 PTX (the route as the layer launches it: polled, the
    plan fused; and polled alone, ``ROUTE_ONLY``) and finalize's, parsed."""
    specs = {}
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        spec = launch_spec(self.fn, args, kwargs)
        name = spec["kernel"]
        if name == "_route_kernel" and not spec["constexprs"]["PLAN"]:
            name = ROUTE_ONLY
        if name != "_route_kernel" or spec["constexprs"]["POLLED"]:
            specs.setdefault(name, spec)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter.InterpretedFunction, "run", recording_run)
        run_mailbox_workload()
    wanted = set(POLLING) | set(PUBLISHING) | {"_finalize_kernel"}
    assert wanted <= set(specs), f"never launched: {sorted(wanted - set(specs))}"
    tmp = tmp_path_factory.mktemp("ptx")
    (tmp / "specs.json").write_text(json.dumps({k: specs[k] for k in sorted(wanted)}))
    here = pathlib.Path(__file__).parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "cache")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here.parent),
                                                      env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", COMPILE, str(tmp / "specs.json"),
                           str(tmp / "ptx.json")], cwd=here, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {k: parse(v) for k, v in json.loads((tmp / "ptx.json").read_text()).items()}


@pytest.mark.parametrize("kernel", POLLING)
def test_polls_are_strong_loads_repeated_in_a_loop(ptx, kernel):
    assert not poll_problems(ptx[kernel])


@pytest.mark.parametrize("kernel", POLLING)
def test_every_poll_is_rearmed_behind_a_barrier(ptx, kernel):
    assert not rearm_problems(ptx[kernel])


def test_the_route_reads_the_mailbox_with_strong_loads_only(ptx):
    """The route's second read of its candidates' words (before it re-arms them) is
    volatile too: a plain load could be served from L1, stale."""
    route = ptx["_route_kernel"]
    reread = at(route, ROUTE_REREAD, "ld")
    assert reread
    assert all(STRONG_LOAD.search(route.instructions[i].text) for i in reread)


def test_logits_words_are_polled_and_published_whole(ptx):
    """The route alone (no plan tiles fused) polls only logits words: each load of them,
    and each store that publishes them, moves 32-bit elements or wider."""
    assert not whole_word_problems(ptx[ROUTE_ONLY], [POLL_FIRST, POLL_AGAIN, ROUTE_REREAD],
                                   "ld")
    assert not whole_word_problems(ptx["_publish_kernel"], [PUBLISH_WORD], "st")


@pytest.mark.parametrize("kernel, lines", [
    ("_publish_kernel", (PUBLISH_WORD, PUBLISH_HALF)),
    ("_publish_partial_kernel", (PUBLISH_PARTIAL,))])
def test_publish_stores_one_a_word_and_peer(ptx, kernel, lines):
    assert not publish_problems(ptx[kernel], lines)


@pytest.mark.parametrize("kernel", POLLING + PUBLISHING)
def test_no_dependent_launch_in_a_mailbox_kernel(ptx, kernel):
    assert not dependent_launch_problems(ptx[kernel])


def test_the_one_dependent_launch_touches_no_mailbox(ptx):
    """Finalize is launched as a dependent of the experts' down kernel (kernels/pdl.py)
    and is the only launch that is; neither polls nor stores into a mailbox, so no
    re-arm and publication meet across that boundary."""
    package = pathlib.Path(finalize_k.__file__).parent.parent
    launches = sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                      if "launch_pdl=" in p.read_text())
    assert launches == ["kernels/finalize.py"], launches
    final = ptx["_finalize_kernel"]
    assert any("griddepcontrol.wait" in ins.text for ins in final.instructions)
    assert not any(STRONG_LOAD.search(ins.text) or ins.file == "mailbox.py"
                   for ins in final.instructions)


# ----------------------------------------------------------------------------- the checker

SYNTHETIC = """
\t.file\t1 "/x/mailbox.py"
$L__BB0_1:
\t.loc\t1 {again} 9
\t{load} {{ %r1 }}, [ %rd1 + 0 ];
\tsetp.eq.s32 %p1, %r1, -2147483648;
\t@%p1 bra \t{target};
$L__BB0_2:
\tret;
"""


@pytest.mark.parametrize("load, target, problem", [
    ("ld.volatile.global.b32", "$L__BB0_1", None),
    ("ld.relaxed.sys.global.b32", "$L__BB0_1", None),
    ("ld.global.b32", "$L__BB0_1", "not strong at system scope"),
    ("ld.relaxed.gpu.global.b32", "$L__BB0_1", "not strong at system scope"),
    ("ld.volatile.global.b32", "$L__BB0_2", "in no loop")])
def test_the_checker_finds_a_weak_or_hoisted_poll(load, target, problem):
    """The checks fail where they should: a poll's re-read that is a plain (or GPU-scope)
    load, or that no branch repeats."""
    text = SYNTHETIC.format(again=POLL_AGAIN[1], load=load, target=target)
    found = [p for p in poll_problems(parse(text)) if "no load" not in p]
    assert (problem is None and not found) or (problem and any(problem in p for p in found))
