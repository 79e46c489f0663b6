"""A record of every Triton kernel a process (and each process it starts) compiles: with this folder on PYTHONPATH
and QERL_COMPILE_LOG=FILE, each `JITFunction._do_compile` call appends a JSON line (pid, wall time at its end,
seconds, the kernel, its constexprs and signature). A call that finds the kernel in Triton's disk cache takes
milliseconds; one that compiles takes tenths of a second. BENCHMARKS.md, "The first step on a fresh machine":

    PYTHONPATH=.:benchmarks/compile_log QERL_COMPILE_LOG=compile.jsonl TRITON_CACHE_DIR=$(mktemp -d) \\
        python3 benchmarks/bench_grpo_step.py --models 7b --schemes nvfp4 --steps 2
"""
import json
import os
import time

if os.environ.get("QERL_COMPILE_LOG"):
    import triton.runtime.jit as _jit

    _do_compile = _jit.JITFunction._do_compile

    def _logged(self, key, signature, device, constexprs, options, attrs, warmup):
        start = time.perf_counter()
        kernel = _do_compile(self, key, signature, device, constexprs, options, attrs, warmup)
        row = {"pid": os.getpid(), "t": time.time(), "s": round(time.perf_counter() - start, 3),
               "fn": f"{self.fn.__module__}.{self.fn.__qualname__}", "constexprs": repr(constexprs)[:300],
               "sig": repr(signature)[:300]}
        with open(os.environ["QERL_COMPILE_LOG"], "a") as f:
            f.write(json.dumps(row) + "\n")
        return kernel

    _jit.JITFunction._do_compile = _logged
