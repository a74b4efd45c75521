"""
lab/vllm_worker.py: vLLM's side of the bench, run by vLLM's own Python (lab/bench_vllm.py starts it):
token ids in, token ids and log-probabilities out, one JSON object a line on stdin and stdout.

It imports only the standard library and vLLM (never the project: vLLM's environment holds its
own torch and transformers), loads the model once with automatic prefix caching, and answers:
  {"generate": [[ids], ...], "max_new_tokens": N, "stop": [ids]}
      greedy continuations, each cut after its first stop id (kept, as the engine keeps it):
      {"outputs": [[ids], ...], "cached": [prompt tokens the prefix cache held], "seconds": s}
  {"probe": [[ids], ...], "token_ids": [ids]}
      the log-probabilities log p(t | prompt) of each of token_ids after each prompt (one
      request a prompt, max_tokens 1, logprob_token_ids: it reads the prefix cache, which a
      prompt_logprobs request skips): {"logprobs": [[lp, ...], ...], "cached": [...], "seconds": s}
  {"reset": true}
      the prefix cache emptied (before each timed run: what a warm-up or an earlier run left
      there would otherwise be found): {"reset": true or false, "seconds": s}
  {"quit": true}
A request with "warmup": true is answered but not profiled (--profile).
The first line it prints is {"ready": true, "startup_s", "threads", "vllm"}; vLLM's own logging
goes to stderr. The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the
caller), so that no scheduler process competes for the cores it is given.

    /work/vllm-venv/bin/python -I lab/vllm_worker.py --model PATH --threads 2   # by lab/bench_vllm.py
(-I: lab/ must not be on its path, or `import kernels` in transformers finds lab/kernels.py.)
"""
import argparse
import cProfile
import json
import os
import pstats
import sys
import time

PROFILE_ROWS = 40  # --profile: the calls printed, by cumulative time


def answer(llm, request):
    """One request's reply (the module docstring's protocol)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    prompts = request.get("generate") or request["probe"]
    start = time.perf_counter()
    if "generate" in request:
        params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"],
                                stop_token_ids=request["stop"], detokenize=False)
    else:
        params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                                logprob_token_ids=request["token_ids"])
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    reply = dict(seconds=time.perf_counter() - start,
                 cached=[o.num_cached_tokens or 0 for o in outs])
    if "generate" in request:
        stop = set(request["stop"])
        reply["outputs"] = [cut(list(o.outputs[0].token_ids), stop) for o in outs]
    else:
        reply["logprobs"] = [[o.outputs[0].logprobs[0][t].logprob for t in request["token_ids"]]
                             for o in outs]
    return reply


def cut(ids, stop):
    """ids up to and including the first stop id."""
    return next((ids[:i + 1] for i, t in enumerate(ids) if t in stop), ids)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=type(
        "HelpFormatter", (argparse.RawDescriptionHelpFormatter,
                          argparse.ArgumentDefaultsHelpFormatter), {}))  # vLLM's Python: no lab
    p.add_argument("--model", required=True, help="the model folder vLLM loads")
    p.add_argument("--threads", type=int, required=True, help="CPU threads vLLM's worker takes")
    p.add_argument("--dtype", default="float32", help="the weights' dtype")
    p.add_argument("--max-model-len", type=int, default=4096, help="vLLM's context length")
    p.add_argument("--profile", metavar="PATH", help="cProfile the requests' handling: its stats "
                   "written to PATH at the end and the calls that cost most printed to stderr")
    args = p.parse_args(argv)
    start = time.perf_counter()
    out = os.fdopen(os.dup(1), "w")  # the protocol's stream; anything else written to the
    os.dup2(2, 1)                    # standard output (vLLM, C libraries) goes to stderr
    sys.stdout = sys.stderr
    import torch
    import vllm
    torch.set_num_threads(args.threads)
    llm = vllm.LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=True,
                   max_model_len=args.max_model_len, seed=0)
    print(json.dumps(dict(ready=True, startup_s=time.perf_counter() - start,
                          threads=torch.get_num_threads(), vllm=vllm.__version__)), file=out, flush=True)
    profile = cProfile.Profile() if args.profile else None
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        if request.get("reset"):
            start = time.perf_counter()
            done = llm.reset_prefix_cache()
            print(json.dumps(dict(reset=bool(done), seconds=time.perf_counter() - start)), file=out,
                  flush=True)
            continue
        if profile and not request.get("warmup"):
            profile.enable()
        reply = answer(llm, request)
        if profile:
            profile.disable()
        print(json.dumps(reply), file=out, flush=True)
    if profile:
        profile.dump_stats(args.profile)
        pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(PROFILE_ROWS)


if __name__ == "__main__":
    main()
