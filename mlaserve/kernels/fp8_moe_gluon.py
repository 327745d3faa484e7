"""The FP8 MoE's W8A8 GEMM1 in Gluon (Hopper): each 128-wide K step's product scaled while the next step's MMAs run.

fp8_moe_gemm.py's GEMM1 adds `dot(a_k, w_k) * scale_k` to its accumulator a K step at a time. Triton waits for
each such MMA before the next one (`wgmma.wait_group 0`: a product that is not a loop-carried accumulator is read
at once), so the tensor cores idle while the step is scaled and added. Here the products of step k go to their own
registers (`use_acc=False`), step k+1's MMAs are issued, and only then is step k waited for
(`warpgroup_mma_wait(num_outstanding=2)`) and scaled into the accumulator, as DeepGEMM promotes its FP8 sums.
The same products are added in the same order with the same scales, so the result has the Triton form's bits.

Operands as the TMA form of fp8_fused_experts has them: x quantized into moe_align's row order (act_quant's
`sorted_pairs`), scales column-major [G, rows]; w13 as [E * 2I, D] rows. One program: BLOCK_M rows of one expert's
block x 128 columns of h (one quantization group): the gate and up tiles, silu(gate) * up, and h's e4m3 with its
scale per row. The shared-memory ring holds STAGES K steps; step k + STAGES - 1 is loaded into the slot of step
k - 1 once step k - 1's MMAs are retired.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .fp8_reference import AMAX_FLOOR, BLOCK, FP8_MAX

# Triton 3.7+ names the TMA load async_load
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_FLOOR = gl.constexpr(AMAX_FLOOR)
_MAX = gl.constexpr(FP8_MAX)


@gluon.jit
def _issue(a_desc, w_desc, bar, a_buf, g_buf, u_buf, r0, rg, I, k):
    """TMA loads of K step k (column k * 128): x rows r0.., gate rows rg.., up rows rg + I.. into one slot."""
    mbarrier.expect(bar, a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes)
    _tma_load(a_desc, [r0, k * 128], bar, a_buf)
    _tma_load(w_desc, [rg, k * 128], bar, g_buf)
    _tma_load(w_desc, [rg + I, k * 128], bar, u_buf)


@gluon.jit
def _gemm1_gluon_kernel(
    a_desc,
    w_desc,
    AS,
    S13,
    H,
    HS,
    ExpertIds,
    NumPadded,
    I,
    D,
    num_m,
    stride_asg,
    stride_se,
    stride_sn,
    stride_sk,
    stride_hm,
    stride_hsm,
    BLOCK_M: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    gl.static_assert(BLOCK_N == 128 and BLOCK_K == 128, "one 128x128 scale block a tile and a K step")
    # grouped order over (row block, column tile), as fused_moe._pid_to_tile
    num_n = gl.cdiv(I, BLOCK_N)
    pid = gl.program_id(0)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size
    pid_n = (pid % (GROUP_M * num_n)) // size
    if pid_m * BLOCK_M >= gl.load(NumPadded):
        return
    e = gl.load(ExpertIds + pid_m).to(gl.int64)
    r0 = pid_m * BLOCK_M
    rg = (e * 2 * I + pid_n * BLOCK_N).to(gl.int32)

    # [BLOCK_M, BLOCK_N] accumulators: 4 warps along M (16 rows each), the rest along N
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, num_warps // 4], instr_shape=[16, BLOCK_N // (num_warps // 4), 32]
    )
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    offs_m = r0 + gl.arange(0, BLOCK_M, layout=rows_l)
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_l)
    as_ptr = AS + offs_m
    sg_ptr = S13 + e * stride_se + pid_n * stride_sn
    su_ptr = sg_ptr + gl.cdiv(I, BLOCK_N) * stride_sn

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    g_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    u_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    nk = gl.cdiv(D, BLOCK_K)
    # prologue: steps 0 .. STAGES-2; step STAGES-1 goes into the last slot while step 0 runs
    for s in gl.static_range(STAGES - 1):
        if s < nk:
            _issue(a_desc, w_desc, bars.index(s), a_bufs.index(s), g_bufs.index(s), u_bufs.index(s), r0, rg, I, s)

    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
    acc_g = zero
    acc_u = zero
    # step 0: issue its MMAs, fetch its scales, load step STAGES-1
    mbarrier.wait(bars.index(0), 0)
    pg = warpgroup_mma(a_bufs.index(0), g_bufs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    pu = warpgroup_mma(a_bufs.index(0), u_bufs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    p_as = gl.load(as_ptr)
    p_sg = gl.load(sg_ptr)
    p_su = gl.load(su_ptr)
    if STAGES - 1 < nk:
        t: gl.constexpr = STAGES - 1
        _issue(a_desc, w_desc, bars.index(t), a_bufs.index(t), g_bufs.index(t), u_bufs.index(t), r0, rg, I, t)
    for k in range(1, nk):
        slot = k % STAGES
        mbarrier.wait(bars.index(slot), (k // STAGES) & 1)
        cg = warpgroup_mma(a_bufs.index(slot), g_bufs.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
        cu = warpgroup_mma(a_bufs.index(slot), u_bufs.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
        c_as = gl.load(as_ptr + k * stride_asg)
        c_sg = gl.load(sg_ptr + k * stride_sk)
        c_su = gl.load(su_ptr + k * stride_sk)
        # step k-1's two MMAs retire (this step's two stay in flight): scale them in, free their slot
        pg, pu = warpgroup_mma_wait(num_outstanding=2, deps=(pg, pu))
        acc_g = acc_g + pg * (p_as[:, None] * p_sg)
        acc_u = acc_u + pu * (p_as[:, None] * p_su)
        nxt = k + STAGES - 1
        if nxt < nk:
            ns = nxt % STAGES
            _issue(a_desc, w_desc, bars.index(ns), a_bufs.index(ns), g_bufs.index(ns), u_bufs.index(ns), r0, rg, I, nxt)
        pg = cg
        pu = cu
        p_as = c_as
        p_sg = c_sg
        p_su = c_su
    pg, pu = warpgroup_mma_wait(num_outstanding=0, deps=(pg, pu))
    acc_g = acc_g + pg * (p_as[:, None] * p_sg)
    acc_u = acc_u + pu * (p_as[:, None] * p_su)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    # h = silu(gate) * up, quantized per row over this 128-column group (fp8_quant.quant_group's maths)
    h = acc_g * (1 / (1 + gl.exp(-acc_g))) * acc_u
    s = gl.div_rn(gl.maximum(gl.max(gl.abs(h), 1), _FLOOR), _MAX)
    q = gl.minimum(gl.maximum(gl.div_rn(h, s[:, None]), -_MAX), _MAX).to(gl.float8e4nv)
    gl.store(H + offs_m.to(gl.int64)[:, None] * stride_hm + offs_n[None, :], q)
    gl.store(HS + offs_m.to(gl.int64) * stride_hsm + pid_n, s)


def gemm1_gluon(a, a_s, w13, s13, h, h_s, expert_ids, num_padded, num_m, block_m, group_m, stages=4, num_warps=8):
    """GEMM1 of the W8A8 TMA form: a e4m3 [rows, D] in moe_align's order with a_s [rows, G] (strides (1, rows));
    w13 e4m3 [E, 2I, D] contiguous, s13 [E, 2*I/128, D/128]; writes h e4m3 [rows, I] and h_s [rows, I/128]. I must
    be a multiple of 128."""
    E, I2, D = w13.shape
    I = I2 // 2
    if I % BLOCK or a_s.stride(0) != 1 or block_m != 64:
        raise ValueError(f"gemm1_gluon: I={I} must be a multiple of {BLOCK}, a_s column-major, BLOCK_M 64")
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, BLOCK], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a, [block_m, BLOCK], a_layout)
    w_desc = TensorDescriptor.from_tensor(w13.view(-1, D), [BLOCK, BLOCK], w_layout)
    _gemm1_gluon_kernel[(num_m * (I // BLOCK),)](
        a_desc,
        w_desc,
        a_s,
        s13,
        h,
        h_s,
        expert_ids,
        num_padded,
        I,
        D,
        num_m,
        a_s.stride(1),
        s13.stride(0),
        s13.stride(1),
        s13.stride(2),
        h.stride(0),
        h_s.stride(0),
        BLOCK_M=block_m,
        GROUP_M=group_m,
        STAGES=stages,
        num_warps=num_warps,
    )


def gluon_available(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device)[0] == 9
