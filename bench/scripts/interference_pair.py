"""The profiler's interference pair alone, on one layer of the LLaMA-3-8B shape: the MLP
(stream 2) beside attention (stream 1) in one scheduling group, at the given shares; prints
and writes the table rows with XLA's schedule of the pair (were both regions issued before
the first finished?) and the timeline's overlap.

    PYTHONPATH=. python3 bench/scripts/interference_pair.py OUT.json [TOKENS] [SHARES]
"""
import json
import sys

from checkpoints.loader import load_model
from search.profiler import LayerOps, interference_table

out = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
shares = [float(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1.0,0.125").split(",")]
lay = LayerOps(load_model("random:llama3-8b", num_layers=1), 2048, 256)
table = interference_table(lay, n, shares, progress=print)
json.dump({"command": " ".join(["python3"] + sys.argv), "table": table}, open(out, "w"),
          indent=1)
