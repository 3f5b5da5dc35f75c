"""sass_hazards.py: a write to the A registers of an MMA group is reported exactly when,
by the PTX rule (``wgmma.wait_group``), the group may still be in flight there: on drawn
instruction sequences of groups, waits and writes in straight-line code and around a
loop, in the text form cuobjdump prints. On a Hopper GPU, also the experts kernels the
JIT compiled there, at every config of that GPU's table."""

import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

import sass_hazards as sh
from wide_moe_triton import LatentMoE, WideMoEConfig, mx, tuning
from wide_moe_triton.kernels import experts as ex
from wide_moe_triton.sharding import shard

WRITERS = [  # (instruction with {r} for the destination, registers it writes from {r})
    ("MOV R{r}, 0x800080", 1), ("IMAD.MOV.U32 R{r}, RZ, RZ, 0x800080", 1),
    ("LOP3.LUT R{r}, R3, 0xff, RZ, 0xc0, !PT", 1), ("PRMT R{r}, R81, 0x7771, RZ", 1),
    ("SHF.R.U32.HI R{r}, RZ, 0x6, R105", 1), ("@P0 MOV R{r}, R4", 1),
    ("LDS.128 R{r}, [R40+0x1200]", 4), ("LDS.64 R{r}, [R40]", 2),
    ("IMAD.WIDE R{r}, R2, 0x4, R6", 2),
]
NOT_WRITERS = ["STS.128 [R{r}], R4", "ISETP.GE.AND P0, PT, R{r}, R2, PT",
               "STG.E [R{r}.64], R4", "BAR.SYNC.DEFER_BLOCKING 0x0"]


def sass(lines: list[str]) -> str:
    """The lines as cuobjdump prints a kernel's SASS (address comments, ';' ends)."""
    return "\n".join(f"        /*{16 * i:04x}*/                   {x} ;"
                     for i, x in enumerate(lines))


def group(bases: list[int]) -> list[str]:
    """One MMA group: an HGMMA a base register (A = base..base+3), the last marked gsb0."""
    return [f"HGMMA.64x16x16.F32.BF16 R200, R{b}, gdesc[UR8], R200"
            + (", gsb0" if i == len(bases) - 1 else "") for i, b in enumerate(bases)]


@settings(max_examples=150, deadline=None)
@given(groups=st.integers(1, 6), per_group=st.integers(1, 2), data=st.data())
def test_a_write_is_a_hazard_exactly_when_its_group_may_be_in_flight(groups, per_group, data):
    bases = [[16 + 8 * (g * per_group + i) for i in range(per_group)] for g in range(groups)]
    lines = [x for g in bases for x in group(g)]
    waits = data.draw(st.none() | st.integers(0, groups), label="wait: groups left in flight")
    if waits is not None:
        lines.append(f"WARPGROUP.DEPBAR.LE gsb0, {waits:#x}")
    in_flight = groups if waits is None else waits
    target = data.draw(st.integers(0, groups - 1), label="group written")
    base = data.draw(st.sampled_from(bases[target]))
    writer, width = data.draw(st.sampled_from(WRITERS))
    offset = data.draw(st.integers(0, 3), label="register of the A operand")
    first = base + offset - data.draw(st.integers(0, width - 1), label="where the write starts")
    lines.append(writer.format(r=first))
    found, register_mmas, loops = sh.kernel_hazards(sass(lines))
    assert register_mmas == groups * per_group and loops == 0
    assert bool(found) == (target >= groups - in_flight), (lines, found)
    if found:
        assert found[0].writer == writer.format(r=first).removeprefix("@P0 ")


@settings(max_examples=60, deadline=None)
@given(groups=st.integers(1, 4), data=st.data())
def test_writes_elsewhere_and_non_writes_are_never_hazards(groups, data):
    lines = [x for g in range(groups) for x in group([16 + 8 * g])]
    # registers no A operand holds, even written 4 wide (the A operands: 16 + 8g .. +3)
    outside = data.draw(st.sampled_from([4, 12, 20, 16 + 8 * groups, 120]), label="register")
    writer, _ = data.draw(st.sampled_from(WRITERS))
    inside = data.draw(st.sampled_from(NOT_WRITERS))
    lines += [writer.format(r=outside), inside.format(r=16 + 8 * data.draw(
        st.integers(0, groups - 1)))]
    found, _, _ = sh.kernel_hazards(sass(lines))
    assert found == [], (lines, found)


@settings(max_examples=60, deadline=None)
@given(left=st.integers(0, 3), before=st.integers(0, 3), after=st.integers(0, 3))
def test_around_a_loop_the_next_iteration_meets_the_groups_left_in_flight(left, before,
                                                                          after):
    """A loop body that loads an A operand, issues its MMA and waits until ``left`` groups
    are in flight: the load of the next iteration overwrites registers an MMA may still
    read exactly when ``left`` >= 1 (the MMA's own group); a full wait at the top of the
    body (``before``) or its end clears it."""
    body = [f"IADD3 R{120 + i}, R1, 0x1, RZ" for i in range(before)]
    body += ["LDS.128 R96, [R40]"] + group([96]) + [f"WARPGROUP.DEPBAR.LE gsb0, {left:#x}"]
    body += [f"IADD3 R{130 + i}, R1, 0x1, RZ" for i in range(after)]
    body.append(f"@P1 BRA 0x{0:04x}")  # back to the body's first line
    found, register_mmas, loops = sh.kernel_hazards(sass(body))
    assert register_mmas == 1 and loops == 1
    assert bool(found) == (left >= 1), (body, found)
    assert all(h.where.startswith("loop") and h.writer == "LDS.128 R96, [R40]" for h in found)


@given(st.sampled_from(WRITERS), st.integers(0, 200))
def test_written_registers_widths(writer, r):
    text, width = writer
    assert sh.written_registers(text.format(r=r)) == set(range(r, r + width))


@given(st.sampled_from(NOT_WRITERS), st.integers(0, 200))
def test_stores_compares_and_barriers_write_no_register(text, r):
    assert sh.written_registers(text.format(r=r)) == set()


def decode_entries(table: dict) -> list[tuple[int, int, dict, dict]]:
    """(L, I, up config, the down config of the same width) of every decode-layout
    experts entry of a tuning table's "kernels" (the staged path's, whose MMAs take the
    weights from registers)."""
    entries = []
    for dims, by_width in table.get(ex.KERNEL_UP, {}).items():
        if dims.endswith("_decode"):
            latent, inter = (int(p[1:]) for p in dims.split("_")[:2])
            downs = table[ex.KERNEL_DOWN][dims]
            entries += [(latent, inter, up, downs[tuning.bucket_for(int(w), downs)])
                        for w, up in by_width.items()]
    return entries


def _on_hopper() -> bool:
    return (torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability()[0] == ex.HOPPER)


@pytest.mark.skipif(not _on_hopper(), reason="needs a Hopper GPU (the JIT's own compiles; "
                    "without one, test_compile.py checks the same configs' SASS)")
def test_experts_compiled_on_this_gpu_leave_no_mma_register_operand_in_flight():
    """Every decode-layout experts config of this GPU's table (and the defaults), at its
    dims with 16 experts (one a rank at TP16), run on this GPU: the kernels the JIT
    compiled here (this machine's Triton and ptxas; those of earlier tests in the process
    too) write no A register of an MMA still in flight."""
    dev = torch.device("cuda")
    table = (tuning.load_table(tuning.gpu_name(dev)) or {}).get("kernels", {})
    entries = {}  # (L, I) -> [(up, down)]
    for latent, inter, up, down in decode_entries(table):
        entries.setdefault((latent, inter), []).append((up, down))
    base = WideMoEConfig.kimi_k3(tp=1).replace(num_experts=16, top_k=4)
    entries.setdefault((base.latent, base.expert_intermediate // 8), []).append(
        (ex.DEFAULT_UP_STAGED, ex.DEFAULT_DOWN_STAGED))
    stock = LatentMoE(base, seed=0, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    for (latent, inter), configs in entries.items():
        assert latent == base.latent, "a table entry at another latent width"
        rank = shard(stock, 0, base.expert_intermediate // inter)
        weights = ex.prepare_weights(rank.w13, rank.w13_scales, rank.w2, rank.w2_scales,
                                     layout="wgmma_decode")
        b = 24
        ids = torch.stack([torch.randperm(base.num_experts, generator=gen, device=dev)
                           [:base.top_k] for _ in range(b)]).int()
        q, qs = mx.quantize_mxfp8(torch.randn(b, latent, generator=gen, device=dev))
        counts, pairs, generation = ex.routing_lists(ids, base.num_experts, b)
        for up, down in configs:
            ex.experts(q, qs, weights, counts, pairs, generation, base.top_k, base.beta,
                       base.linear_beta, config_up=up, config_down=down)
    torch.cuda.synchronize()
    # every experts kernel compiled in this process (other tests' too): none may race
    with_register_mmas = {}
    for fn in (ex._experts_up_kernel, ex._experts_down_kernel):
        for kernel in fn.device_caches[torch.cuda.current_device()][0].values():
            found, register_mmas, _ = sh.kernel_hazards(sh.sass_of(kernel.asm["cubin"]))
            assert not found, f"{fn.__name__}: {len(found)} hazards, first {found[0]}"
            with_register_mmas[fn.__name__] = (with_register_mmas.get(fn.__name__, 0)
                                               + (register_mmas > 0))
    assert all(with_register_mmas.get(n, 0) >= len(entries)
               for n in ("_experts_up_kernel", "_experts_down_kernel")), with_register_mmas
