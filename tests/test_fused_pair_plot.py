"""The overlap-pair benches (bench/kernels/fused_pair.py, green_context_pair.py), their
shared record (pair_record.py) and the plot that reads both: records built with the
functions the benches call, gains checked against the raw times, both benches' main() run
on the CPU with stand-ins for the GPU parts, and the clear failure on a box without CUDA."""
import contextlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "kernels"))
import fused_pair  # noqa: E402
import green_context_pair  # noqa: E402
import plot_fused_pair  # noqa: E402
from nanojax.profiling import pair_record as pr  # noqa: E402


def _power(clock, watts):
    return pr.summarise([(0.1, 9999.0, 1.0, None), (0.5, clock, watts, "0x4")], settle_s=0.3)


def _case(name, ms, clock=1500.0, watts=690.0):
    return pr.case(name, ms, _power(clock, watts))


def _record(impl, args, shares, gemm_sms):
    """shares: {gemm: [(G, pair ms) or (G, None) for an error]}; b2b is 1.0 ms each."""
    rec = pr.header(impl, "test", "H200", 132, args)
    rec["attention_full"] = _case("attention_full", 0.5)
    for name, rows in shares.items():
        b2b = _case(f"{name} b2b", 1.0, clock=1600.0, watts=695.0)
        entry = rec["gemms"][name] = pr.gemm_entry(name, b2b, gemm_full=_case("g", 0.4))
        for g, ms in rows:
            if ms is None:
                pr.add_share(entry, pr.error_row(g, RuntimeError("CUDA driver error 1")))
                continue
            pr.add_share(entry, pr.share_row(
                g, gemm_sms(g), 132 - gemm_sms(g), _case("gemm", 0.6), _case("att", 0.7),
                _case("pair", ms, clock=1400.0 + g, watts=700.0), b2b))
    return rec


@pytest.fixture
def records(tmp_path):
    argv = ["--out", str(tmp_path / "x.json")]
    fused = _record("nanojax fused launch", fused_pair.parse_args(argv),
                    {"qkv": [(88, 0.8), (44, 1.0), (66, None)], "o": [(66, None)]},
                    gemm_sms=lambda g: g)
    green = _record("torch green contexts", green_context_pair.parse_args(argv),
                    {"qkv": [(44, 0.95), (110, 1.05)]},
                    gemm_sms=lambda g: -(-g // 8) * 8)  # the group rounded up to 8
    green["gemms"]["down"] = {"error": "RuntimeError('out of memory')"}
    paths = tmp_path / "fused.json", tmp_path / "green.json"
    for path, rec in zip(paths, (fused, green)):
        path.write_text(json.dumps(rec))
    return paths


def test_record_rows_and_best_share(records):
    fused = json.loads(records[0].read_text())
    entry = fused["gemms"]["qkv"]
    assert [r["G"] for r in entry["shares"]] == [88, 44, 66]
    assert "error" in entry["shares"][2] and entry["best_G"] == 88
    assert entry["shares"][0]["back_to_back_over_pair"] == pytest.approx(1.0 / 0.8)
    assert entry["shares"][0]["pair_over_slower_part"] == pytest.approx(0.8 / 0.7)
    assert fused["gemms"]["o"]["best_G"] is None  # only an error row
    power = entry["shares"][0]["pair"]["power"]  # the sample before settle_s is dropped
    assert power["samples"] == 1 and power["sm_clock_mhz_mean"] == 1488.0
    assert power["throttle_reasons"] == ["0x4"]


def test_series_gains_are_back_to_back_over_pair(records):
    fused, green = (json.loads(p.read_text()) for p in records)
    s = plot_fused_pair.series(fused, "qkv")
    assert s["gemm_sms"] == [44, 88] and s["errors"] == 1  # sorted, the error row left out
    assert s["gain"] == pytest.approx([1.0 / 1.0, 1.0 / 0.8])
    assert s["clock"] == [1444.0, 1488.0] and s["back_to_back_power"] == 695.0
    g = plot_fused_pair.series(green, "qkv")
    assert g["G"] == [44, 110] and g["gemm_sms"] == [48, 112]  # x: the SMs it got
    assert g["gain"] == pytest.approx([1.0 / 0.95, 1.0 / 1.05])
    assert plot_fused_pair.series(green, "down") is None
    assert plot_fused_pair.series(green, "gate_up") is None
    assert plot_fused_pair.series(fused, "o")["gain"] == []


def test_plot_writes_a_png_with_and_without_the_green_record(records, tmp_path, capsys):
    out = tmp_path / "both.png"
    plot_fused_pair.main([str(records[0]), str(records[1]), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    alone = tmp_path / "alone.png"
    plot_fused_pair.main([str(records[0]), str(tmp_path / "absent.json"), "--out",
                          str(alone)])
    assert alone.stat().st_size > 20_000 and "absent.json" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="could be read"):
        plot_fused_pair.main([str(tmp_path / "a.json"), "--out", str(tmp_path / "n.png")])
    # a profile of `nanojax profile --pair-shares` is read through its "pair"
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"ops": {}, "pair": json.loads(records[0].read_text())}))
    assert plot_fused_pair.load(str(profile)) == plot_fused_pair.load(str(records[0]))


def test_both_benches_take_the_same_shapes(capsys):
    argv = ["--out", "x.json", "--shares", "44,88", "--gemms", "qkv,down"]
    fused, green = fused_pair.parse_args(argv), green_context_pair.parse_args(argv)
    assert green.shares == [44, 88] and green.gemms == ["qkv", "down"]
    assert {k: v for k, v in vars(fused).items() if k != "programs"} == vars(green)
    with pytest.raises(SystemExit):
        green_context_pair.parse_args(["--out", "x", "--gemms", "qkv,mlp"])
    assert "unknown ['mlp']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        green_context_pair.parse_args(["--out", "x", "--shares", "44,a"])
    assert "--shares" in capsys.readouterr().err


def test_green_bench_names_what_a_cpu_box_lacks(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    out = tmp_path / "g.json"
    with pytest.raises(SystemExit) as e:
        green_context_pair.main(["--out", str(out)])
    assert "sees no CUDA device" in str(e.value)
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        assert "cuda.bindings is not installed" in str(e.value)
    assert not out.exists()


def test_power_sampler_reads_a_query_and_survives_no_nvidia_smi():
    assert pr.parse_sample("1485, 690.12, 0x0000000000000004\n") == (
        1485.0, 690.12, "0x0000000000000004")
    assert pr.parse_sample("[N/A], 690.1") is None
    fake = pr.PowerSampler(0, ms=20, settle_s=0.0)
    fake.cmd = [sys.executable, "-c", "print('1500, 700.5, 0x4')"]
    fake.start()
    import time
    time.sleep(0.5)
    got = fake.stop()
    assert got["samples"] >= 1 and got["sm_clock_mhz_mean"] == 1500.0
    assert got["power_w_max"] == 700.5 and got["throttle_reasons"] == ["0x4"]
    absent = pr.PowerSampler(0, ms=20)
    absent.cmd = ["/nonexistent/nvidia-smi"]
    absent.start()
    assert absent.stop() is None


def test_fused_bench_record_on_the_cpu_feeds_the_plot(tmp_path, monkeypatch):
    """fused_pair.main end to end at tiny decode shapes, the GPU kernels replaced by their
    f32 references (the record's plumbing, not the kernels, is under test)."""
    from pallas_kernels import decode_attention_swapab as swapab
    from pallas_kernels import fused_gemm_attention_mgpu as fused
    from pallas_kernels.decode_attention import decode_attention_reference
    from pallas_kernels.matmul_mgpu import matmul_reference
    monkeypatch.setattr(fused, "gemm_part", lambda a, b, **kw: matmul_reference(a, b))
    monkeypatch.setattr(swapab, "decode_attention_swapab", lambda q, *att, **kw: (
        decode_attention_reference(q.astype("float32"), *att)))

    def fused_stand_in(a, b, *att, gemm_programs, num_programs):
        if gemm_programs == 66:
            raise ValueError("no room for the attention")
        return fused.fused_reference(a, b, *att)
    monkeypatch.setattr(fused, "fused_gemm_attention", fused_stand_in)
    out = tmp_path / "fused.json"
    fused_pair.main(["--out", str(out), "--gemms", "o", "--shares", "44,66", "--tokens", "8",
                     "--batch", "2", "--ctx", "32", "--iters", "1", "--reps", "1",
                     "--power-seconds", "0", "--programs", "132"])
    rec = json.loads(out.read_text())
    assert rec["impl"] == "nanojax fused launch" and rec["ctx"] == 32
    entry = rec["gemms"]["o"]
    assert [r["G"] for r in entry["shares"]] == [44, 66] and "error" in entry["shares"][1]
    assert entry["best_G"] == 44 and entry["fused_rel_error"]["G"] == 44
    assert entry["fused_rel_error"]["gemm"] < 1e-6
    row = entry["shares"][0]
    assert row["gemm_sms"] == 44 and row["attention_sms"] == 88 and row["pair"]["power"] is None
    s = plot_fused_pair.series(rec, "o")
    assert s["gain"] == pytest.approx([entry["back_to_back"]["ms"] / row["pair"]["ms"]])
    plot_fused_pair.main([str(out), "--out", str(tmp_path / "f.png")])
    assert (tmp_path / "f.png").stat().st_size > 20_000


def _res(n):
    return SimpleNamespace(sm=SimpleNamespace(smCount=n))


class _Driver:
    """cuda.bindings.driver's calls that green_context_pair.py makes, on a stand-in
    device of 132 SMs that rounds a group up to 8 and fails one larger than the device."""
    CUdevResourceType = SimpleNamespace(CU_DEV_RESOURCE_TYPE_SM=1)
    CUgreenCtxCreate_flags = SimpleNamespace(CU_GREEN_CTX_DEFAULT_STREAM=1)
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
    made = []

    @staticmethod
    def cuDevSmResourceSplitByCount(groups, sm, flags, count):
        got = -(-count // 8) * 8
        if got > sm.sm.smCount:
            return (1,)
        return 0, [_res(got)], 1, _res(sm.sm.smCount - got)

    cuDeviceGet = staticmethod(lambda i: (0, "dev"))
    cuDeviceGetDevResource = staticmethod(lambda dev, kind: (0, _res(132)))
    cuDevResourceGenerateDesc = staticmethod(lambda res, n: (0, res[0]))

    @classmethod
    def cuGreenCtxCreate(cls, desc, dev, flags):
        cls.made.append(desc.sm.smCount)
        return 0, desc

    cuGreenCtxStreamCreate = staticmethod(lambda ctx, flags, prio: (0, 7))


def test_green_split_keeps_the_gemm_count_nearest_g():
    """GreenContexts.split against the stand-in driver."""
    green = object.__new__(green_context_pair.GreenContexts)
    green.cu, green.sm, green.total = _Driver, _res(132), 132

    def counts(g):
        gemm, att, side = green.split(g)
        return gemm.sm.smCount, att.sm.smCount, side
    assert counts(44) == (44, 88, "attention")  # 88 is a whole number of groups
    assert counts(66) == (72, 60, "gemm")  # a tie goes to the GEMM's group
    assert counts(130) == (124, 8, "attention")  # a GEMM group of 136 does not fit
    with pytest.raises(ValueError, match="no SMs"):
        green.split(132)


def test_green_bench_record_on_the_cpu(tmp_path, monkeypatch):
    """green_context_pair.main end to end on the CPU: torch's CPU tensors under a stand-in
    torch.cuda, the stand-in driver; one share's contexts fail to come up."""
    torch = pytest.importorskip("torch")

    class Stream:
        def __init__(self, handle=0):
            self.handle = handle

        def wait_stream(self, other):
            assert isinstance(other, Stream)

    cuda = SimpleNamespace(
        init=lambda: None, synchronize=lambda: None, current_stream=Stream,
        stream=lambda s: contextlib.nullcontext(), ExternalStream=Stream,
        get_device_name=lambda i: "stand-in")
    fake = SimpleNamespace(
        cuda=cuda, device=lambda name: torch.device("cpu"), zeros=torch.zeros,
        randn=torch.randn, bfloat16=torch.float32, __version__=torch.__version__,
        Generator=lambda device: torch.Generator(device="cpu"))
    real_split = green_context_pair.GreenContexts.split

    def split(self, g):
        if g == 66:
            raise RuntimeError("CUDA driver error 801")
        return real_split(self, g)
    monkeypatch.setattr(green_context_pair.GreenContexts, "split", split)
    monkeypatch.setattr(green_context_pair, "require_cuda", lambda: (fake, _Driver))
    out = tmp_path / "green.json"
    green_context_pair.main(["--out", str(out), "--gemms", "o", "--shares", "44,66,110",
                             "--tokens", "4", "--batch", "2", "--ctx", "16", "--iters", "1",
                             "--reps", "1", "--power-seconds", "0"])
    rec = json.loads(out.read_text())
    assert rec["impl"] == "torch green contexts" and rec["programs"] == 132
    assert "not pages" in rec["kv_layout"] and rec["attention_full"]["ms"] > 0
    entry = rec["gemms"]["o"]
    assert [(r["G"], r.get("gemm_sms"), r.get("attention_sms"), r.get("split_group"))
            for r in entry["shares"]] == [(44, 44, 88, "attention"), (66, None, None, None),
                                          (110, 112, 20, "gemm")]
    assert "801" in entry["shares"][1]["error"] and entry["best_G"] in (44, 110)
    assert _Driver.made[-4:] == [44, 88, 112, 20]  # the contexts got the chosen counts
    s = plot_fused_pair.series(rec, "o")
    assert s["gemm_sms"] == [44, 112] and s["gain"] == pytest.approx(
        [entry["back_to_back"]["ms"] / r["pair"]["ms"] for r in entry["shares"][::2]])


def test_gemm_tiles_bench_names_a_bad_choice(capsys):
    """bench/kernels/gemm_tiles.py: the tile shapes it times all fit one block's shared
    memory, and an unknown GEMM or tile is refused by name."""
    import gemm_tiles
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    from pallas_kernels import fused_gemm_attention_mgpu as fused
    for tm, tn, tk, steps in gemm_tiles.TILES.values():
        cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=tk, max_concurrent_steps=steps,
                              epi_tile_m=64, epi_tile_n=64)
        assert fused.gemm_smem_bytes(jnp.bfloat16, cfg) <= fused.SMEM_BYTES
    for bad, says in ((["--gemms", "qkv,lm_head"], "unknown"), (["--tiles", "64x64"], "unknown"),
                      (["--tokens", "1024,1e99"], "integers"), (["--tokens", "1000"], "128")):
        with pytest.raises(SystemExit):
            gemm_tiles.parse_args(["--out", "x.json", *bad])
        assert says in capsys.readouterr().err
