"""
lab/bench_load.py: lab.bench's comparison again on a busy machine (python -m lab.bench --load N).

--load N runs the same comparison a second time beside N processes that each spin on a core
(busy_load), and reports LOADED_FIGURES of it apart (print_loaded): what the engine and the
baselines give when other work shares the machine, each on the threads it chose. N is at most the
machine's cores (os.cpu_count(): lab.bench refuses more in one line before anything starts).

    PYTHONPATH=. python -m lab.bench --dialogues 2 --turns 1 --max-new-tokens 8 --load 2
"""
import sys
from contextlib import contextmanager

import torch

@contextmanager
def busy_load(n):
    """n processes spinning on a core each while the block runs (a loaded machine); ended,
    each by its own id, when it ends, and each ends itself should this process die first."""
    import subprocess
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()



LOADED_FIGURES = ("engine_tok_s", "hf_generate_tok_s", "hf_generate_batch_tok_s",
                  "speedup_vs_generate", "speedup_vs_generate_batch", "greedy_match",
                  "decode_step_ms", "prefill_tok_s")


def print_loaded(args, figures, res):
    """The comparison run beside --load busy processes (its figures, res by implementation)."""
    print(f"loaded: the same workload beside {args.load} busy-loop processes "
          f"({torch.get_num_threads()} torch threads)")
    for k, r in res.items():
        print(f"{k:<18}{r['wall']:>8.1f}{r['gen']:>9}{r['tok_s']:>8.1f}")
    hf, cb = figures["speedup_vs_generate"], figures["speedup_vs_generate_batch"]
    if hf:
        print(f"speedup loaded: {hf:.2f}x vs hf generate" + (f", {cb:.2f}x vs hf generate_batch"
                                                            if cb else "")
              + f"; greedy_match {figures['greedy_match']}")
    print(f"engine decode step loaded {figures['decode_step_ms']:.1f} ms; prefill "
          f"{figures['prefill_tok_s']:.0f} tok/s")

