"""On a GPU: after start-up (graph capture and the warm-up, engine/warmup.py) a varied workload compiles no Triton
kernel: prompts of 1 to 8k tokens, batches of 1 to max_num_seqs, mixed prefill + decode steps, chunked prompts,
prefix hits, sampled and greedy rows, and EAGLE3 verifies. Compiles are counted by Triton's post-compile hook (a
miss of a kernel's in-memory cache: a disk-cache hit counts too, it still stalls the step); a failure names each
kernel variant that compiled, which says what the warm-up plan misses."""

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

MAX_SEQS = 64
CHUNK = 2048


class CompileCounter:
    """Triton's jit_post_compile_hook while installed: every kernel variant compiled (name, launch options,
    argument types, constexprs and specialization)."""

    def __init__(self):
        self.compiled: list[str] = []

    def __enter__(self):
        import triton

        self.knobs = triton.knobs.runtime
        self.prev = self.knobs.jit_post_compile_hook
        self.knobs.jit_post_compile_hook = self._hook
        return self

    def _hook(self, *, repr, compile, **info):
        # the name and launch options, then what tells variants apart: the argument types, the constexprs and the
        # specialized attributes (an int equal to 1 or divisible by 16, a 16-byte aligned pointer)
        head = repr.split("](")[0] + "]"
        self.compiled.append(
            f"{head} signature={compile.get('signature')} constants={compile.get('constants')} "
            f"attrs={compile.get('configs')}"
        )
        return None

    def __exit__(self, *exc):
        self.knobs.jit_post_compile_hook = self.prev


def _llm(ckpt, spec=None, kv_cache_dtype="auto"):
    from mlaserve import LLM

    return LLM(
        ckpt,
        device="cuda",
        dtype="bfloat16",
        kv_cache_dtype=kv_cache_dtype,
        speculative_config=spec,
        max_model_len=16448,
        max_num_seqs=MAX_SEQS,
        max_num_batched_tokens=8192,
        chunked_prefill_size=CHUNK,
        num_pages=4096,
        page_size=64,
    )


def _workload(llm) -> None:
    """Prompt lengths 1..8k alone; batches 1..MAX_SEQS of mixed lengths and output lengths (requests finish at
    different steps while others prefill: mixed steps); repeated prompts (prefix hits); sampled rows."""
    from mlaserve import SamplingParams

    rng = random.Random(20260724)
    greedy = dict(temperature=0, ignore_eos=True)
    lengths = [1, 2, 3, 5, 15, 16, 17, 31, 33, 63, 64, 65, 100, 255, 256, 257, 1000, 2047, 2049, 4095, 4097, 8191, 8192]
    for n in lengths:
        llm.generate([[rng.randrange(512) for _ in range(n)]], SamplingParams(max_tokens=3, **greedy), use_tqdm=False)
    for b in (1, 2, 3, 5, 8, 13, 17, 31, 33, 47, MAX_SEQS):
        prompts = [[rng.randrange(512) for _ in range(rng.choice([1, 7, 40, 300, 1500]))] for _ in range(b)]
        params = [SamplingParams(max_tokens=rng.randrange(1, 40), **greedy) for _ in range(b)]
        params = [  # sampled rows beside greedy ones (with speculation: verified on the device by their rule)
            p if i % 3 else SamplingParams(max_tokens=p.max_tokens, temperature=0.8, top_p=0.9, seed=i)
            for i, p in enumerate(params)
        ]
        llm.generate(prompts, params, use_tqdm=False)
        llm.generate(prompts[: max(1, b // 2)], params[: max(1, b // 2)], use_tqdm=False)  # prefix-cache hits
    # long prompts arriving while others decode: the engine interleaves their chunks with decode steps
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (6000, 3, 9, 2500, 70, 8000, 1)]
    llm.generate(prompts, [SamplingParams(max_tokens=m, **greedy) for m in (5, 60, 40, 8, 30, 2, 64)], use_tqdm=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "speculative,kv_cache_dtype",
    [(False, "auto"), (True, "auto"), ("ngram", "auto"), ("mtp", "auto"), (False, "fp8"), ("int4", "auto")],
    ids=["plain", "eagle3", "ngram", "mtp", "fp8kv", "int4"],
)
def test_no_triton_compile_after_start_up(tiny_ckpt, tmp_path, speculative, kv_cache_dtype, request):
    pytest.importorskip("triton")
    spec = None
    if speculative == "int4":  # INT4 experts: the GEMV and the GEMM's row bands (moe_config.INT4_ROW_BANDS)
        tiny_ckpt = request.getfixturevalue("int4_ckpt")
    elif speculative == "ngram":  # the lookup kernel, in the step graphs and eagerly (mixed steps, sampled rows)
        spec = {"algorithm": "NGRAM", "num_steps": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    elif speculative == "mtp":  # the checkpoint's MTP layer (MLA + MoE) as the draft, K=2
        from mlaserve.models.make_random import make_random

        tiny_ckpt = make_random("tiny", str(tmp_path / "m"), seed=0, dtype="float32", progress=False, mtp=True)
        spec = {"algorithm": "MTP", "num_steps": 2}
    elif speculative:
        from mlaserve.models.make_random_draft import make_random_draft

        draft = make_random_draft("tiny-eagle3", str(tmp_path / "d"), target=tiny_ckpt, dtype="float32")
        spec = {"draft_model": draft, "num_steps": 1}  # verify width 2, as the seed's protocol runs
    with CompileCounter() as start:
        llm = _llm(tiny_ckpt, spec, kv_cache_dtype)
    assert start.compiled, "start-up compiled nothing: the hook is not called on this Triton"
    assert llm.engine.warmup_seconds is not None
    print(f"\nstart-up: {len(start.compiled)} kernel variants, warm-up {llm.engine.warmup_seconds:.1f}s")
    with CompileCounter() as serving:
        _workload(llm)
        torch.cuda.synchronize()
    assert not serving.compiled, f"{len(serving.compiled)} Triton compiles while serving:\n" + "\n".join(
        sorted(set(serving.compiled))
    )


@pytest.mark.parametrize("k", [2, 3])
def test_eagle3_chains_start_with_the_warm_up(tiny_ckpt, tmp_path, k):
    """A chain of K > 1 draft steps through the whole start-up warm-up (its chunks' pages must cover the K - 1 draft
    tokens past each step), then greedy outputs equal to plain decoding's."""
    from mlaserve import SamplingParams
    from mlaserve.models.make_random_draft import make_random_draft

    draft = make_random_draft("tiny-eagle3", str(tmp_path / "d"), target=tiny_ckpt, dtype="float32")
    rng = random.Random(k)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 63, 64, 65, 300)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm = _llm(tiny_ckpt, {"draft_model": draft, "num_steps": k})
    assert llm.engine.warmup_seconds is not None
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()
    plain = _llm(tiny_ckpt)
    assert got == [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.close()


def test_close_gives_the_memory_back(tiny_ckpt):
    """LLM.close() frees weights, KV cache and graphs: a second LLM sized from free memory (the default) starts."""
    from mlaserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    before = torch.cuda.memory_allocated()  # what earlier tests in this process still hold
    llm = LLM(tiny_ckpt, device="cuda", dtype="bfloat16", max_num_seqs=8)
    want = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids
    llm.close()
    kept = torch.cuda.memory_allocated() - before
    assert kept < 256 << 20, f"{kept} bytes still allocated after close ({before} before the LLM)"
    again = LLM(tiny_ckpt, device="cuda", dtype="bfloat16", max_num_seqs=8)
    assert again.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids == want
    again.close()
