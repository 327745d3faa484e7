"""Mutation testing of the core modules with mutmut: each module mutated alone, against the tests that cover it.

    pip install -e ".[mutation]"
    python tools/mutation.py                      # every module below, one after another
    python tools/mutation.py spec/verify.py       # one module (a key of MODULES)
    python tools/mutation.py --list               # the modules and their tests
    python tools/mutation.py --recheck spec/verify.py  # the last run's survivors against the tree's tests now

Each module runs in its own copy of the tree (build/mutation/<name>/, mutmut writes its mutants/ there), with a
pyproject.toml whose [tool.mutmut] mutates that one file and runs only its tests, one mutant at a time (the tests
are CPU-bound: --max-children 1 unless given). The result of each module (killed, survived, timed out, and the
surviving mutants' names) goes to build/mutation/<name>.json and is printed; `mutmut show NAME` run in
build/mutation/<name>/ prints a mutant's diff. docs/testing.md holds the last scores and why each survivor is
accepted.

--recheck runs each mutant the last run left alive (build/mutation/<name>.json) against the module's tests as the
tree has them now (copied into the mutants' tree), one pytest per mutant with MUTANT_UNDER_TEST set, and prints
which of them the new tests kill: the check after adding tests for survivors, without a whole new run (mutmut
would redo every mutant when the test selection changes).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "mutation"

# module (under mlaserve/) -> the tests that cover it, quickest first
MODULES = {
    "engine/kv_pool.py": [
        "tests/engine/test_kv_pool.py",
        "tests/engine/test_parallel_sampling.py::test_n_shares_prompt_pages",
    ],
    "engine/scheduler.py": [  # the engine tests that schedule: admission, prefix hits, sharing, aborts, preemption
        "tests/engine/test_scheduler_unit.py",
        "tests/engine/test_scheduler_admit_unit.py",
        "tests/engine/test_admission.py",
        "tests/engine/test_engine_behaviour.py",
        "tests/engine/test_parallel_sampling.py::test_n_shares_prompt_pages",
        "-k",
        "not batch_invariance and not logprobs and not stop_strings",
    ],
    "spec/verify.py": ["tests/spec/test_verify_rules.py"],
    "spec/ngram.py": [  # the rule's and the rows' tests, one engine run of each path, one with predictions
        "tests/spec/test_ngram.py",
        "-k",
        "rule or lookup or proposer or longest or longer_than or without_a_row or (equal_plain and 1-1-3)"
        " or (overlapped_and and 1) or (ending_and and 3) or (preemption and 1) or (prediction_drafts and 1)",
    ],
    "models/deepseek_mtp.py": ["tests/spec/test_mtp.py"],  # the layer against transformers', every draft checked
    "spec/mtp.py": ["tests/spec/test_mtp.py", "tests/tp/test_tp_llm.py::test_llm_tp2_mtp_matches_tp1"],
    "engine/step_broadcast.py": [  # the codec and channel alone, then a sharded draft's steps under TP2
        "tests/tp/test_step_broadcast.py",
        "tests/tp/test_tp_llm.py::test_llm_tp2_mtp_matches_tp1",
    ],
    "layers/sampler.py": [
        "tests/unit/test_sampler.py",
        "tests/unit/test_logits_process.py",
        "tests/engine/test_engine_behaviour.py::test_sampled_logprobs_equal_a_reference_log_softmax",
        "tests/kernels_interp/test_race_sample_interp.py::test_race_into_kernel_equals_reference",
        "tests/kernels_interp/test_race_sample_interp.py::test_race_into_kernel_one_filter_a_batch",
    ],
    "layers/logits_process.py": [  # the processors against the per-token reference, through sample(), a grammar's
        "tests/unit/test_logits_process.py",
        "tests/unit/test_sampler.py",
        "tests/engine/test_structured.py",
    ],
    "engine/grammar.py": [  # the compiler, the matcher's rows, spec's verify rows; Kimi's tiktoken vocabulary
        "tests/engine/test_structured.py",
        "tests/server/test_tools_reasoning.py",
    ],
    "bench/compare.py": ["tests/bench/test_compare.py"],
    "kernel_config.py": [  # the switches, thresholds and their checks; the environment; deterministic mode's pins
        "tests/unit/test_kernel_config.py",
        "tests/unit/test_deterministic_flag.py",
    ],
    "detokenizer.py": ["tests/unit/test_detokenizer.py"],
    "layers/quant.py": ["tests/unit/test_int4_pack.py", "tests/unit/test_quant_formats.py"],  # the formats' maths
    "quantization.py": [  # the published forms parsed, every refusal's field and value, which linears are quantized
        "tests/unit/test_quant_config.py",
        "tests/unit/test_quant_checkpoint_errors.py",
    ],
    "models/weights.py": [  # the refusals, the loader's parts and log, sharded reads under TP and EP, the forms
        "tests/unit/test_weights_loader.py",
        "tests/unit/test_checkpoint_errors.py",
        "tests/unit/test_quant_checkpoint_errors.py",
        "tests/tp/test_sharded_load.py",
        "tests/model/test_checkpoint_forms.py",
        "tests/model/test_quantized.py",
        "tests/model/test_fp8_kv_b.py",
    ],
    "models/weight_bytes.py": [  # a loaded model's bytes by kind, the meta-device plan, the make-random --plan lines
        "tests/unit/test_weight_plan.py",
        "tests/model/test_quant_memory.py",
        "tests/model/test_fp8_kv_b.py",
        "tests/model/test_quant_dummy.py",
        "tests/unit/test_make_random.py",
        "-k",
        "plan or memory or bytes or copy or quant",
    ],
    "server/serving.py": [  # its steps alone, then the HTTP tests: refusals, sampling fields, streams, a failed step
        "tests/server/test_serving_body.py",
        "tests/server/test_serving_steps.py",
        "tests/server/test_errors.py",
        "tests/server/test_sampling_api.py",
        "tests/server/test_api.py",
        "tests/server/test_engine_death.py",
    ],
}
# module -> the functions mutated (mutmut's name globs); absent: all. compare.py: the identity check (what decides
# the exit code); its figures, table, prose and CLI printing are presentation, ~500 more mutants that a CPU shared
# with others cannot afford each run
FUNCTIONS = {
    "bench/compare.py": ["load_runs", "_first_diff", "_request_diffs", "identity_problems", "config_warnings"],
}


def mutant_globs(module: str) -> list[str]:
    dotted = "mlaserve." + module.removesuffix(".py").replace("/", ".")
    return [f"{dotted}.x_{f}__mutmut_*" for f in FUNCTIONS.get(module, [])]


def _toml_list(xs: list[str]) -> str:
    return "[" + ", ".join(json.dumps(x) for x in xs) + "]"


def prepare(module: str) -> Path:
    """A copy of the tree for one module, its pyproject.toml carrying the [tool.mutmut] section."""
    work = OUT / module.replace("/", "_").removesuffix(".py")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    for d in ("mlaserve", "tests"):
        shutil.copytree(ROOT / d, work / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    tests = MODULES[module]
    conf = (ROOT / "pyproject.toml").read_text()
    conf += (
        "\n[tool.mutmut]\n"
        'source_paths = ["mlaserve"]\n'
        f"only_mutate = {_toml_list(['mlaserve/' + module])}\n"
        f"pytest_add_cli_args_test_selection = {_toml_list(tests)}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q"]\n'
        'process_isolation = "fork"\n'
        "use_git_change_detection = false\n"
    )
    (work / "pyproject.toml").write_text(conf)
    return work


def results(work: Path, globs: list[str]) -> dict[str, list[str]]:
    """`mutmut results --all true` -> {status: [mutant names]}, of the mutants matching globs (all when empty)."""
    out = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    by: dict[str, list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+):\s*(.+?)\s*$", line)
        if m and (not globs or any(fnmatch.fnmatch(m[1], g) for g in globs)):
            by.setdefault(m[2], []).append(m[1])
    return by


def run(module: str, max_children: int) -> dict:
    work = prepare(module)
    # the copy's mlaserve (mutmut puts mutants/ first on the path), never the tree's: drop the root from PYTHONPATH
    keep = [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x and Path(x).resolve() != ROOT]
    # one torch thread: no OpenMP pool for the forked mutant runs to inherit (fork from a process with a live pool
    # can hang), and a fair share of a shared CPU
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(keep), OMP_NUM_THREADS="1")
    print(f"== {module}: mutmut over {' '.join(MODULES[module])} (log: {work}.log)", flush=True)
    with open(f"{work}.log", "w") as log:
        cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children), *mutant_globs(module)]
        subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    by = results(work, mutant_globs(module))
    killed = len(by.get("killed", []))
    total = sum(len(v) for v in by.values())
    summary = {
        "module": module,
        "tests": MODULES[module],
        "functions": FUNCTIONS.get(module, "all"),
        "total": total,
        "killed": killed,
        "counts": {k: len(v) for k, v in sorted(by.items())},
        "not_killed": {k: v for k, v in sorted(by.items()) if k != "killed"},
        "score": killed / total if total else None,
    }
    (OUT / f"{work.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"== {module}: {killed}/{total} killed; {summary['counts']}", flush=True)
    for status, names in summary["not_killed"].items():
        for n in names:
            print(f"   {status}: {n}")
    return summary


def recheck(module: str) -> dict[str, list[str]]:
    """The last run's survivors of `module` against its current tests -> {"killed": [...], "survived": [...]}."""
    work = OUT / module.replace("/", "_").removesuffix(".py")
    summary = json.loads((OUT / f"{work.name}.json").read_text())
    shutil.copytree(ROOT / "tests", work / "mutants" / "tests", dirs_exist_ok=True)
    keep = [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x and Path(x).resolve() != ROOT]
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(work / "mutants"), *keep]), OMP_NUM_THREADS="1")
    out: dict[str, list[str]] = {"killed": [], "survived": []}
    for name in (n for names in summary["not_killed"].values() for n in names):
        env = dict(base, MUTANT_UNDER_TEST=name)
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *MODULES[module]]
        try:  # exit 1: a test failed; a mutant that loops (timed out) is caught too
            rc = subprocess.run(cmd, cwd=work / "mutants", env=env, capture_output=True, timeout=600).returncode
        except subprocess.TimeoutExpired:
            rc = 1
        out["killed" if rc == 1 else "survived"].append(name)
        print(f"   {'killed' if rc == 1 else f'survived (pytest exit {rc})'}: {name}", flush=True)
    (OUT / f"{work.name}.recheck.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"== {module}: {len(out['killed'])} of {len(out['killed']) + len(out['survived'])} survivors now killed")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("modules", nargs="*", help="keys of MODULES (default: all)")
    p.add_argument("--max-children", type=int, default=1, help="mutants tested at once (default: 1)")
    p.add_argument("--list", action="store_true", help="print the modules and their tests")
    p.add_argument("--recheck", action="store_true", help="the last run's survivors against the current tests")
    args = p.parse_args(argv)
    if args.list:
        for m, t in MODULES.items():
            print(f"{m}: {' '.join(t)}")
        return 0
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        p.error(f"unknown module(s) {unknown}; choose from {list(MODULES)}")
    for m in args.modules or list(MODULES):
        recheck(m) if args.recheck else run(m, args.max_children)
    return 0


if __name__ == "__main__":
    sys.exit(main())
