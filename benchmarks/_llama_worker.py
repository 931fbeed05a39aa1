"""llama.cpp's side of a benchmark, in its own process (not a benchmark itself: `make bench` skips files starting
with `_`).

llama-cpp-python is built outside the project's environment (its build takes ~10 minutes, and its flags matter:
`benchmarks/cpu_decode.py` says which), so a benchmark runs this file with that environment's Python and talks to
it over pipes: one JSON request a line on stdin, one JSON reply a line on stdout. The benchmark's own process
decides when each side runs, so the rounds stay interleaved.

    python _llama_worker.py GGUF THREADS N_CTX
    request: {"prompt": [token ids], "new_tokens": N}
    reply:   {"ttft": seconds to the first token, "rate": decode tokens/s after it, "tokens": [ids]}
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from llama_cpp import Llama

    gguf, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        prompt, new_tokens = request["prompt"], request["new_tokens"]
        llm.reset()
        tokens: list[int] = []
        start = time.perf_counter()
        first = None
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True):
            if first is None:
                first = time.perf_counter()
            tokens.append(token)
            if len(tokens) == new_tokens:
                break
        end = time.perf_counter()
        rate = (len(tokens) - 1) / (end - first) if len(tokens) > 1 else 0.0
        print(json.dumps({"ttft": first - start, "rate": rate, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
