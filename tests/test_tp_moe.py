"""Tensor parallelism of MoE models on fake CPU devices (a subprocess: the device count is
fixed when JAX starts): the experts' FFN width (and a shared expert's) is split over the
shards, and TP 2 gives TP 1's greedy tokens."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = r'''
import json, sys
from nanojax.config import named_shape
from nanojax.engine.llm import LLM
from nanojax.engine.sampling import SamplingParams
from nanojax.models import init_params
from nanojax.models.bundle import ModelBundle
from nanojax.parallel.tp import model_shardings
cfg = named_shape("tiny-moe", "float32").replace(shared_expert_intermediate_size=int(sys.argv[1]))
params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
prompts = [[1, 5, 9, 33, 7], [100, 200, 300]]
out = {}
for tp in (1, 2):
    bundle = ModelBundle(cfg, init_params(cfg, shardings=model_shardings(cfg, tp) if tp > 1
                                          else None), None)
    llm = LLM(bundle, b_dense=32, max_model_len=64, tensor_parallel_size=tp)
    out[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
print("RESULT " + json.dumps(out))
'''


@pytest.mark.parametrize("shared", [0, 32], ids=["experts", "shared-expert"])
def test_moe_tp2_tokens_equal_tp1(shared):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(shared)], capture_output=True,
                       text=True, timeout=600, env=env, cwd=ROOT)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["1"] == out["2"]


def test_an_expert_width_tp_does_not_divide_is_refused():
    from nanojax.config import named_shape
    from nanojax.errors import ConfigError
    from nanojax.parallel.tp import TPLayout
    cfg = named_shape("tiny-moe").replace(moe_intermediate_size=50)
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        TPLayout(cfg, 4)
