"""The ncu profile parser on a synthetic raw CSV (no GPU, no ncu): case split, units, stalls, mismatch."""

import csv
import io

import pytest

from benchmarks.cases import model_cases
from benchmarks.profile import DEFAULT_CASES, parse, select

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
COLS = {  # column -> unit (ncu's second row)
    "ID": "",
    "Process ID": "",
    "Process Name": "",
    "Host Name": "",
    "Kernel Name": "",
    "Context": "",
    "Stream": "",
    "Block Size": "",
    "Grid Size": "",
    "Device": "",
    "CC": "",
    "dram__bytes_read.sum": "Kbyte",
    "dram__bytes_write.sum": "Kbyte",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "%",
    "gpu__time_duration.sum": "usecond",
    "launch__registers_per_thread": "register/thread",
    "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active": "%",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": "%",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "%",
    **{STALL.format(r): "" for r in ("long_scoreboard", "selected", "wait", "barrier", "math_pipe_throttle")},
}
CUTLASS = "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(T1::Params)"
MANIFEST = [
    {
        "model": "qwen3-4b-random",
        "phase": "decode",
        "op": "linear",
        "shape": "qkv 1x2560->6144",
        "variant": "bf16",
        "backend": "triton",
        "nbytes": 31_000_000,
        "flops": 0,
    },
    {
        "model": "qwen3-4b-random",
        "phase": "decode",
        "op": "attention",
        "shape": "T=1 ctx=8192",
        "variant": "int8kv",
        "backend": "torch",
        "nbytes": 20_000_000,
        "flops": 0,
    },
]


def kernel(id_, name, us="", rd="", wr="", stalls=(), **extra):
    row = {
        "ID": str(id_),
        "Process ID": "4,242",
        "Process Name": "python",
        "Host Name": "h",
        "Kernel Name": name,
        "Context": "1",
        "Stream": "7",
        "Block Size": "(128, 1, 1)",
        "Grid Size": "(256, 1, 1)",
        "Device": "0",
        "CC": "9.0",
        "dram__bytes_read.sum": rd,
        "dram__bytes_write.sum": wr,
        "gpu__time_duration.sum": us,
    }
    row.update({STALL.format(r): v for r, v in stalls})
    return {**row, **extra}


def raw_csv(rows, cols=COLS):
    f = io.StringIO()
    w = csv.writer(f, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(cols)
    w.writerow(cols.values())
    for r in rows:
        w.writerow([r.get(c, "") for c in cols])
    return "==PROF== Disconnected\n" + f.getvalue()


ROWS = [  # deliberately not in ID order: the parser sorts by ID
    kernel(3, "_gemv_int8_kernel", us="10"),
    kernel(0, "_ncu_case_marker", us="1.5"),
    kernel(
        1,
        "void gemv_kernel<128, 4>(const __nv_bfloat16*, int)",
        us="1,000",
        rd="1,500,000",
        wr="500,000",
        stalls=[
            ("long_scoreboard", "12.3"),
            ("selected", "5"),
            ("wait", "3.1"),
            ("barrier", "1.5"),
            ("math_pipe_throttle", "0.2"),
        ],
        **{
            "launch__registers_per_thread": "40",
            "sm__warps_active.avg.pct_of_peak_sustained_active": "61.26",
            "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active": "40",
            "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": "55.5",
            "dram__throughput.avg.pct_of_peak_sustained_elapsed": "41.04",
        },
    ),
    kernel(2, "_ncu_case_marker", us="1.5"),
    kernel(4, CUTLASS, us="30"),
]


def test_kernels_are_assigned_to_the_case_of_the_preceding_marker():
    kernels, summary = parse(raw_csv(ROWS), MANIFEST)
    assert [(k["op"], k["backend"], k["kernel"]) for k in kernels] == [
        ("linear", "triton", "gemv_kernel"),
        ("attention", "torch", "_gemv_int8_kernel"),
        ("attention", "torch", "cutlass_80_tensorop_bf16_s16816gemm_relu"),
    ]
    assert [(s["op"], s["kernels"], s["us"], s["longest"]) for s in summary] == [
        ("linear", 1, 1000.0, "gemv_kernel"),
        ("attention", 2, 40.0, "cutlass_80_tensorop_bf16_s16816gemm_relu"),
    ]
    assert summary[1]["eff_GBps"] == 500  # 20 MB in 40 us


def test_units_and_thousands_separators():
    k = parse(raw_csv(ROWS), MANIFEST)[0][0]
    assert k["us"] == 1000.0
    assert k["dram_GBps"] == 2000  # 2,000,000 Kbyte = 2 GB in 1,000 us
    assert (k["dram_pct"], k["occupancy_pct"], k["regs"]) == (41.0, 61.3, 40)
    assert (k["grid"], k["block"]) == ("(256,1,1)", "(128,1,1)")
    assert k["sm_pct"] is None and k["mem_pct"] is None and k["issue_pct"] is None  # columns absent


def test_stall_ranking_and_top_pipe():
    kernels, _ = parse(raw_csv(ROWS), MANIFEST)
    assert kernels[0]["stalls"] == "long_scoreboard 12.3, wait 3.1, barrier 1.5"  # "selected" is no stall
    assert kernels[0]["top_pipe"] == "fma 55.5%"
    assert kernels[1]["stalls"] is None and kernels[1]["top_pipe"] is None and kernels[1]["dram_GBps"] is None


def test_missing_metric_columns_give_none():
    cols = {c: u for c, u in COLS.items() if c not in ("gpu__time_duration.sum", "dram__bytes_write.sum")}
    k = parse(raw_csv(ROWS, cols), MANIFEST)[0][0]
    assert k["us"] is None and k["dram_GBps"] is None and k["stalls"].startswith("long_scoreboard")


def test_marker_count_mismatch_raises():
    with pytest.raises(ValueError, match="2 case markers but the manifest lists 1"):
        parse(raw_csv(ROWS), MANIFEST[:1])
    with pytest.raises(ValueError, match="no ncu raw CSV header"):
        parse("==ERROR== no kernels were profiled\n", [])


@pytest.mark.parametrize("manifest", [{}, [1, 2], None, [{"model": "a", "nbytes": "x"}]])
def test_malformed_manifest_raises(manifest):
    with pytest.raises(ValueError, match="not a list of"):
        parse(raw_csv(ROWS), manifest)


def test_case_selection():
    cases = model_cases("qwen3-4b-random")
    default = select(cases, DEFAULT_CASES)
    assert {(c.phase, c.op) for c in default} == {(p, o) for p, o in (s.split(":") for s in DEFAULT_CASES.split(","))}
    assert len(select(cases, "decode:attention")) == 6  # 1k, 8k, 32k x bf16, int8kv
    (one,) = select(cases, "decode:attention:int8kv:ctx=8192")
    assert (one.shape, one.variant) == ("T=1 ctx=8192", "int8kv")
    assert [c.shape for c in select(cases, "prefill:linear::gate_up_plain")] == [
        "gate_up_plain 1024x2560->19456"
    ] * 2 + ["gate_up_plain 512x2560->19456"] * 2
