"""The schedule report read from optimized HLO: which main-stream work XLA put between a
side-stream region's start and done (text modelled on jax 0.11's GPU dumps)."""
import pytest

from checkpoints.loader import load_model
from nanojax.profiling.hlo_schedule import entry_instructions, report, side_regions
from nanojax.cli import main
from nanojax.errors import CheckpointError

HLO = """HloModule jit_step, is_scheduled=true

%async_computation (p: bf16[8]) -> bf16[8] {
  %p = bf16[8]{0} parameter(0)
  ROOT %n = bf16[8]{0} negate(%p), frontend_attributes={_scheduling_group_id="9"}
}

ENTRY %main.30 (a: bf16[8], w: bf16[8,8]) -> (bf16[8], bf16[8,8]) {
  %a = bf16[8]{0} parameter(0)
  %w = bf16[8,8]{1,0} parameter(1)
  %call-start = ((bf16[8]{0}), bf16[8]{0}) async-start(%a), calls=%async_computation, frontend_attributes={_scheduling_group_id="1",_xla_stream_annotation="1",inlineable="false"}
  %custom-call.3 = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(%w, %w), custom_call_target="__cublas$lt$matmul"
  %gte = bf16[8,8]{1,0} get-tuple-element(%custom-call.3), index=0
  %gemm_fusion_dot_general.35 = bf16[8,8]{1,0} fusion(%gte, %w), kind=kCustom, calls=%f
  %call-done = bf16[8]{0} async-done(%call-start), frontend_attributes={_scheduling_group_id="1",_xla_stream_annotation="1",inlineable="false"}
  %call-start.1 = ((bf16[8]{0}), bf16[8]{0}) async-start(%call-done), calls=%async_computation, frontend_attributes={_xla_stream_annotation="1",inlineable="false"}
  %call-done.1 = bf16[8]{0} async-done(%call-start.1), frontend_attributes={_xla_stream_annotation="1",inlineable="false"}
  %all-gather-start = (bf16[8]{0}, bf16[16]{0}) all-gather-start(%a), dimensions={0}
  %all-gather-done = bf16[16]{0} all-gather-done(%all-gather-start)
  ROOT %t = (bf16[8]{0}, bf16[8,8]{1,0}) tuple(%call-done.1, %gemm_fusion_dot_general.35)
}
"""


def test_side_regions_and_the_work_between_start_and_done():
    instrs = entry_instructions(HLO)
    assert [x["name"] for x in instrs][:3] == ["a", "w", "call-start"]
    regions = side_regions(instrs)
    assert len(regions) == 2  # the collective is no side-stream region
    first, second = regions
    assert first["group"] == first["done_group"] == "1" and first["stream"] == "1"
    assert first["gemms_between"] == 2 and first["ops_between"] == 2  # GTE is a no-op
    assert second["gemms_between"] == 0 and second["group"] is None


def test_report_reads_a_dump_directory(tmp_path):
    (tmp_path / "module_1.jit_step.sm_9.0a_gpu_after_optimizations.txt").write_text(HLO)
    rep = report(tmp_path)
    assert rep["side_regions"] == 2 and rep["regions_with_a_gemm_between"] == 1
    assert rep["instructions_in_a_group"] == 2 and rep["gemms_in_a_group"] == 0
    with pytest.raises(ValueError, match="ENTRY"):
        entry_instructions("HloModule m\n")


def test_hlo_schedule_cli_names_a_bad_path(tmp_path, capsys):
    assert main(["bench", "hlo-schedule", str(tmp_path)]) == 2
    assert "after_optimizations" in capsys.readouterr().err


def test_random_shape_can_keep_its_first_layers():
    assert load_model("random:tiny", num_layers=1).config.num_layers == 1
    with pytest.raises(CheckpointError, match="positive"):
        load_model("random:tiny", num_layers=0)
    with pytest.raises(CheckpointError, match="random"):
        load_model("smollm2-135m", num_layers=1)


def test_the_interference_pair_schedule_says_whether_both_regions_were_issued_together():
    from search.profiler import _pair_schedule
    serial = _pair_schedule(HLO)  # the second region starts after the first is done
    assert serial["side_regions"] == 2 and not serial["issued_together"]
    lines = HLO.splitlines()
    i = next(n for n, ln in enumerate(lines) if ln.strip().startswith("%call-done ="))
    j = next(n for n, ln in enumerate(lines) if ln.strip().startswith("%call-start.1 ="))
    lines[i], lines[j] = lines[j].replace("async-start(%call-done)", "async-start(%a)"), lines[i]
    same_stream = _pair_schedule("\n".join(lines))  # overlapping, but both on stream 1
    assert not same_stream["issued_together"]
    other = "\n".join(lines).replace(
        '%call-start.1 = ((bf16[8]{0}), bf16[8]{0}) async-start(%a), calls=%async_computation, '
        'frontend_attributes={_xla_stream_annotation="1"',
        '%call-start.1 = ((bf16[8]{0}), bf16[8]{0}) async-start(%a), calls=%async_computation, '
        'frontend_attributes={_xla_stream_annotation="2"')
    together = _pair_schedule(other)
    assert together["issued_together"]
    assert [r["stream"] for r in together["regions"]] == ["1", "2"]


# GPU-style: nano-batch 0's all-reduce (after its o_proj) runs while nano-batch 1's GEMMs
# are issued; nano-batch 1's all-reduce has only its own batch's GEMM before its done
TP_HLO = """HloModule jit_step, is_scheduled=true

ENTRY %main (x: bf16[8,8], w: bf16[8,8]) -> bf16[8,8] {
  %x = bf16[8,8]{1,0} parameter(0)
  %w = bf16[8,8]{1,0} parameter(1)
  %o0 = bf16[8,8]{1,0} custom-call(%x, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/shard_map/nanoop_o_proj_b0/dot_general"}
  %all-reduce-start = bf16[8,8]{1,0} all-reduce-start(%o0), replica_groups={{0,1}}, to_apply=%add, metadata={op_name="jit(step)/shard_map/nanoop_o_allreduce_b0/psum"}
  %q1 = bf16[8,8]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot.1, metadata={op_name="jit(step)/shard_map/nanoop_qkv_b1/dot_general"}
  %o1 = bf16[8,8]{1,0} custom-call(%q1, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/shard_map/nanoop_o_proj_b1/dot_general"}
  %all-reduce-done = bf16[8,8]{1,0} all-reduce-done(%all-reduce-start)
  %all-reduce-start.1 = bf16[8,8]{1,0} all-reduce-start(%o1), replica_groups={{0,1}}, to_apply=%add, metadata={op_name="jit(step)/shard_map/nanoop_o_allreduce_b1/psum"}
  %m0 = bf16[8,8]{1,0} custom-call(%all-reduce-done, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/shard_map/nanoop_mlp_b0/dot_general"}
  %m1 = bf16[8,8]{1,0} custom-call(%q1, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/shard_map/nanoop_mlp_b1/dot_general"}
  %all-reduce-done.1 = bf16[8,8]{1,0} all-reduce-done(%all-reduce-start.1)
  ROOT %r = bf16[8,8]{1,0} add(%m0, %all-reduce-done.1)
}
"""


def test_collective_pairs_and_the_other_nano_batch_gemms_between(tmp_path, capsys):
    from nanojax.profiling.hlo_schedule import collective_pairs
    pairs = collective_pairs(entry_instructions(TP_HLO))
    assert [(p["nano_op"], p["nano_batch"]) for p in pairs] == [("o_allreduce", 0),
                                                                 ("o_allreduce", 1)]
    first, second = pairs
    assert first["gemms_between"] == 2 and first["other_batch_gemms_between"] == 2
    assert second["gemms_between"] == 2 and second["other_batch_gemms_between"] == 1
    f = tmp_path / "step_after_optimizations.txt"
    f.write_text(TP_HLO)
    assert main(["bench", "hlo-schedule", str(f)]) == 0
    import json
    rep = json.loads(capsys.readouterr().out)
    assert rep["collectives"] == 2 and rep["collectives_with_other_batch_gemm_between"] == 2
