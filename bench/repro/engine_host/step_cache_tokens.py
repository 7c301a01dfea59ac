"""Does a step executable loaded from the step cache compute what a fresh compile does?
Three starts, each its own process, one fresh cache directory: `fresh` (step cache off),
`store` (step cache on, empty: compiles and stores), `load` (step cache on: loads every
shape). Each start generates greedy tokens for the same prompts with the platform's
traced forward (a forward that dispatches its own layers is swapped for UnrolledForward,
which the cache covers); the JSON says whether the three agree token for token.

    python bench/repro/engine_host/step_cache_tokens.py OUT.json [--model smollm2-135m]
"""
import json
import os
import sys


def child(args) -> dict:
    import jax
    from nanojax import compile_cache
    compile_cache.enable(args.cache)
    from checkpoints.loader import load_model
    from nanojax.config import EngineConfig
    from nanojax.engine.forward import UnrolledForward, default_forward
    from nanojax.engine.llm_engine import LLMEngine
    from nanojax.engine.sampling import SamplingParams
    bundle = load_model(f"random:{args.model}", dtype=args.dtype)
    forward = default_forward(bundle.config)
    if not forward.traced:
        forward = UnrolledForward(bundle.config)
    eng = LLMEngine(bundle, EngineConfig(b_dense=args.b_dense, num_pages=256,
                                         max_model_len=512, max_num_seqs=8, fixed_shapes=True,
                                         step_cache=args.step_cache), forward=forward)
    eng.runner.warmup()
    rng = __import__("numpy").random.default_rng(0)
    vocab = bundle.config.vocab_size
    for i, n in enumerate((7, 33, 150, 300)):
        eng.add_request(rng.integers(0, vocab, n).tolist(),
                        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                        request_id=str(i))
    done = eng.run_to_completion()
    return {"tokens": {k: o.outputs[0].token_ids for k, o in sorted(done.items())},
            "shapes_loaded": eng.runner.num_loaded, "forward": type(forward).__name__,
            "backend": jax.default_backend(), "jax": jax.__version__}


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from step_cache_start import start_parser, starts_in_one_cache
    ap = start_parser()
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    runs = starts_in_one_cache(
        [__file__, args.out, "--model", args.model, "--dtype", args.dtype, "--b-dense",
         str(args.b_dense)], (("fresh", False), ("store", True), ("load", True)))
    same = {name: r["tokens"] == runs["fresh"]["tokens"] for name, r in runs.items()}
    result = {"command": "python " + " ".join(sys.argv), "model": f"random:{args.model}",
              "dtype": args.dtype, "b_dense": args.b_dense, "runs": runs,
              "same_tokens_as_fresh": same, "cpus": os.cpu_count()}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"same_tokens_as_fresh": same,
                      "loaded": {k: r["shapes_loaded"] for k, r in runs.items()}}))


if __name__ == "__main__":
    main()
