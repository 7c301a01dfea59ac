"""The host's cost of one constrained step's grammar mask (GrammarCompiler.bitmask) for a
2,048-row batch of the LLaMA-3 vocabulary (128,256 ids, SmolLM2's tokenizer), with 0, 512
and 2,048 rows under a JSON schema; median of 20 calls. CPU only (no device work).

    python bench/repro/structured/mask_host_cpu.py OUT.json
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    from checkpoints.loader import load_model
    from nanojax.engine.structured import GrammarCompiler, StructuredOutputsParams
    bundle = load_model("smollm2-135m", dtype="float32")
    grammars = GrammarCompiler(bundle.tokenizer, 128256, bundle.config.eos_token_ids)
    spec = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"},
                                         "minItems": 100000})
    matchers = [grammars.matcher(spec) for _ in range(2048)]
    for m in matchers:
        m.consume_token(bundle.tokenizer.encode("[")[0])
    res = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(),
           "rows": 2048, "vocab_size": 128256, "ms_median": {}}
    for k in (0, 512, 2048):
        rows = [(matchers[i], i) for i in range(k)]
        times = []
        for _ in range(20):
            t = time.perf_counter()
            grammars.bitmask(rows, 2048)
            times.append(1e3 * (time.perf_counter() - t))
        res["ms_median"][str(k)] = statistics.median(times)
        print(k, "constrained rows:", round(res["ms_median"][str(k)], 2), "ms", flush=True)
    Path(sys.argv[1]).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
