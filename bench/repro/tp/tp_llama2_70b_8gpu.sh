#!/bin/bash
# Issue 23, eight GPUs: LLaMA-2-70B shape (random bf16) at TP=8, NanoFlow's configuration
# (8xA100 there; 8xH200 here): 16.1 GiB of weights per GPU, KV 40 KiB per token per GPU
# (8 KV heads, one per GPU). The plan is searched from the H200 datasheet profile; re-plan
# from a measured profile with
#   nanojax profile --model random:llama2-70b --tp 8 --out prof.json && \
#   nanojax search --profile prof.json --tp 8 --out plan.json
# Usage: OUT=dir PART="step engine" bash bench/repro/tp/tp_llama2_70b_8gpu.sh
exec env MODEL=llama2-70b TP=8 bash "$(dirname "$0")/tp_llama3_70b.sh"
