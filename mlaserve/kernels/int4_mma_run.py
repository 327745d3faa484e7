"""Running the tensor-core INT4 GEMV (int4_mma_gemv.py): when it applies, its tiles, and the launches."""

from __future__ import annotations

import torch
import triton

from .int4_mma import check_layout
from .int4_mma_gemv import _int4_mma_gemv1_kernel, _int4_mma_gemv2_kernel

PAIR_MAX = 128  # every program scans the step's ids: a [PAIR_MAX] load
PAIR_MIN_SHARED = 0.05


def pair_worthwhile(pairs: int, E: int) -> bool:
    """Pair experts (_partner) in steps of 2..PAIR_MAX pairs where, drawn at random over the E local experts, at
    least PAIR_MIN_SHARED of them would share an expert: the pairing's scan and registers slow a step whose pairs
    share nothing, and real routings share more than random ones (docs/performance.md)."""
    if not 1 < pairs <= PAIR_MAX:
        return False
    distinct = E * (1.0 - (1.0 - 1.0 / E) ** pairs)
    return 1.0 - distinct / pairs >= PAIR_MIN_SHARED


def pair_width(tokens: int, K: int, E: int, num_experts: int = 0) -> int:
    """The pairing scan's width (a power of 2 >= tokens * K; 0: no pairing) for a step of `tokens` tokens of top-K
    over E local experts of num_experts in all (0: E; EP: a rank's pairs share an expert as often as the step's
    pairs share one of all the experts): one token shares no expert, and pairing needs pair_worthwhile."""
    pairs = tokens * K
    return triton.next_power_of_2(pairs) if tokens > 1 and pair_worthwhile(pairs, num_experts or E) else 0


def mma_config(D: int, I: int, pairs: int, owned: float | None = None) -> tuple[dict, dict]:
    """(gemv1, gemv2) tiles for a step of `pairs` (token, k) pairs of which the rank is expected to own `owned`
    (default all; EP: pairs x its share of the experts; the others' programs exit at once). Kernels_bench's MMA
    sweep on an H200 (docs/experiments.md): the kernels stream best with many small programs resident at once: 2 x
    8 rows (MR 2) a program of 4 warps, capped at 64 registers so 8 programs (32 warps) fit an SM, and all of a
    one-token step's gemv1 programs in one wave (Kimi-K2.5: 1024). gemv1 with fewer owned row blocks than that
    (MoE-TP shards at 1-2 tokens, EP ranks): 8 gate rows a program (MR 1), 8 warps over 32-group trips, unrolled
    (UNROLL), at 128 registers (two programs an SM): ptxas then issues later trips' loads during earlier trips'
    MMAs, and the smaller programs beat MR 2 (at 168 registers too, MoE-TP8) by 2-6 % (benchmarks/gemv1_tiles.py).
    gemv2 (K = I): 2 warps over 8-group trips at one token a request with every pair local (16 programs an SM),
    else 4 warps over 16-group trips (an EP rank's few owned pairs: benchmarks/int4_ep_owned.py), or 2 over 8 at
    I = 256 (one trip) with one 16-row block a program."""
    ng2 = I // 32
    owned = pairs if owned is None else owned
    if owned * triton.cdiv(I, 16) >= 1024:
        c1 = dict(MR=2, WG=4, MUL=False, maxnreg=64)
    else:
        c1 = dict(MR=1, WG=8, MUL=False, UNROLL=True, maxnreg=128)
    if ng2 % 16 == 0 and pairs <= 8 and owned >= pairs:
        c2 = dict(MR=2, WG=2, MUL=False, maxnreg=64)
    elif ng2 % 16 == 0:  # steps of several tokens pair experts (more live registers): 72, 7 programs an SM
        c2 = dict(MR=2, WG=4, MUL=False, **(dict(maxnreg=72) if ng2 >= 64 else {}))
    else:
        c2 = dict(MR=1, WG=2 if ng2 % 8 == 0 else 1, MUL=False)
    return c1, c2


def mma_preferred(D: int, I: int, pairs: int) -> bool:
    """Where the tensor-core GEMV measured faster than the FMA one (kernels_bench --only int4_moe and
    benchmarks/gemv1_unroll.py; numbers in docs/performance.md): the whole Kimi-K2.5 expert and its EP shards
    (I >= 1024) at every step, the MoE-TP4 and TP8 shards (I = 512, 256) at one token; smaller shards and the
    shards' steps of several tokens stay on FMAs."""
    return I >= 1024 or (I >= 256 and pairs <= 8)


def mma_supported(x: torch.Tensor, D: int, I: int) -> bool:
    """The tensor-core GEMV needs bf16 activations on sm_80+ compiled kernels (mma.sync m16n8k16 bf16), x pairs
    addressable as int32 (even row stride), and rows whose words and scales start on 16 / 8 bytes (D, I multiples
    of 128: 16 words, 4 scales); everything else takes the FMA GEMV."""
    if x.dtype != torch.bfloat16 or D % 128 or I % 128 or x.stride(0) % 2 or x.storage_offset() % 2:
        return False
    if not x.is_cuda:  # CPU tensors reach Triton only under the interpreter; tests/interp_mma.py emulates the MMA
        return True
    return torch.cuda.get_device_capability(x.device)[0] >= 8


def int4_gemv_mma(
    x, w13, s13, w2, s2, topk_weights, topk_ids, expert_offset, hbuf, y, pdl, c1, c2, pair=True, plan_tokens=0,
    num_experts=0,
):  # fmt: skip
    """Both GEMVs into hbuf [TK, I] (bf16, pair order) and y [TK, D] (the caller checked every shape and
    mma_supported). c1 / c2: {"MR", "WG", "PREFETCH", "MUL", "NS", "maxnreg"}, c1's "UNROLL" and c2's "NB" (gemv1:
    8 MR gate rows a program, gemv2: NB blocks of 16 MR rows; WG warps; NS: cp.async stages; maxnreg: a register
    cap, for more programs an SM; UNROLL: K's trips unrolled at compile time, int4_mma._mma_dot's NGC). pair: the pairs
    of one expert two at a time (each expert's weights read once for both; steps of up to PAIR_MAX pairs), decided
    for max(T, plan_tokens) tokens (int4_fused_experts' plan) over num_experts in all (0: E; pair_width)."""
    T, D = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    K = topk_ids.shape[-1]
    ids = topk_ids.reshape(-1)
    ng1, ng2 = D // 32, I // 32
    for c, ng in ((c1, ng1), (c2, ng2)):
        if "num_warps" in c or ng % 4:
            raise ValueError(
                f"MMA GEMV config {c}: WG sets the warps (no num_warps); K/32={ng} must be a multiple of 4"
            )
    x32 = x.view(torch.int32)
    TK = T * K
    tkp = pair_width(max(T, plan_tokens), K, E, num_experts) if pair else 0
    k1 = _int4_mma_gemv1_kernel[(TK * triton.cdiv(I, 8 * c1["MR"]),)](
        x32,
        w13,
        s13,
        hbuf,
        ids,
        I,
        ng1,
        TK,
        x32.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1) // 4,
        hbuf.stride(0),
        expert_offset,
        E,
        TOPK=K,
        TKP=tkp,
        MR=c1["MR"],
        WG=c1["WG"],
        EVEN=ng1 % (4 * c1["WG"]) == 0 and I % (8 * c1["MR"]) == 0,
        PREFETCH=c1.get("PREFETCH", False),
        MUL=c1.get("MUL", False),
        NS=c1.get("NS", 1),
        NGC=ng1 if c1.get("UNROLL", False) else 0,
        num_warps=c1["WG"],
        num_stages=1,
        maxnreg=c1.get("maxnreg"),
        **pdl,
    )
    h32 = hbuf.view(torch.int32)
    nb = c2.get("NB", 1)
    if nb & (nb - 1) or (nb > 1 and ng2 > 4 * c2["WG"]):
        raise ValueError(f"MMA GEMV config {c2}: NB must be a power of 2, and > 1 only with K/32={ng2} <= 4 WG")
    k2 = _int4_mma_gemv2_kernel[(TK * triton.cdiv(triton.cdiv(D, 16 * c2["MR"]), nb),)](
        h32,
        w2,
        s2,
        y,
        topk_weights.reshape(-1),
        ids,
        D,
        ng2,
        TK,
        h32.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1) // 4,
        y.stride(0),
        expert_offset,
        E,
        TKP=tkp,
        MR=c2["MR"],
        WG=c2["WG"],
        NB=nb,
        EVEN=ng2 % (4 * c2["WG"]) == 0 and D % (16 * c2["MR"]) == 0,
        PREFETCH=c2.get("PREFETCH", False),
        MUL=c2.get("MUL", False),
        NS=c2.get("NS", 1),
        num_warps=c2["WG"],
        num_stages=1,
        maxnreg=c2.get("maxnreg"),
        **pdl,
    )
    check_layout(k1, c1["WG"])
    check_layout(k2, c2["WG"])
