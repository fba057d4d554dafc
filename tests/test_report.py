"""The sweep report on a synthetic runs folder (no model runs): tables, speed ratios, plots, errors."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from tileinfer import report
from tileinfer.jobs import tables

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CTX = {"1k": 1024, "8k": 8192}
# (quant, weights, kv_cache, smooth_keys, decode speed factor against bf16, mean KL)
CONFIGS = [
    ("bf16", "bf16", "bf16", False, 1.0, 0.0),
    ("int8_weights", "int8", "bf16", False, 1.6, 2e-3),
    ("int8_kv", "bf16", "int8", True, 1.1, 4e-4),
    ("int8_kv", "bf16", "int8", False, 1.1, 3e-3),
    ("int8_both", "int8", "int8", True, 1.8, 2.5e-3),
]
N = 96  # scored positions per row


def fake_row(quant, weights, kv, smooth, speed, kl, *, ctx, prompt_set, rng, finished="2025-01-01T00:00:00+00:00"):
    """A plausible row as :func:`tables.make_row` writes it, and its per-position arrays."""
    kl_pos = torch.from_numpy(rng.exponential(kl, N) * np.linspace(0.5, 1.5, N)).float() if kl else torch.zeros(N)
    dp = torch.from_numpy(rng.normal(0, 0.1 * kl**0.5, N)).float()
    top1 = kl_pos < 4 * kl if kl else torch.ones(N, dtype=torch.bool)
    base_prefill, base_decode = 3000.0 / (1 + CTX[ctx] / 4096), 40.0 * (1 + rng.random() * 0.1)
    kls = kl_pos.double().numpy()
    row = {
        "model": "smollm2-135m",
        "model_sha256": "ab" * 32,
        "quant": quant,
        "weights": weights,
        "kv_cache": kv,
        "smooth_keys": smooth,
        "smooth_alpha": 0.5 if smooth else None,
        "ctx": ctx,
        "ctx_tokens": CTX[ctx],
        "prompt_set": prompt_set,
        "prompts_sha256": f"hash of the {prompt_set} prompt",  # identity columns the report must not split on
        "calibration_sha256": "hash of the calibration text" if smooth else None,
        "n_prompts": 1,
        "backend": "reference",
        "spec": "none",
        "dtype": "bfloat16",
        "kl_mean": float(kls.mean()),
        "kl_median": float(np.median(kls)),
        "kl_p90": float(np.quantile(kls, 0.9)),
        "kl_p99": float(np.quantile(kls, 0.99)),
        "kl_p999": float(np.quantile(kls, 0.999)),
        "kl_max": float(kls.max()),
        "rkl_mean": float(kls.mean()),
        "top1_agree": float(top1.float().mean()),
        "ppl_base": 3.2,
        "ppl_cand": 3.2 * (1 + kl),
        "ln_ppl_ratio": float(np.log1p(kl)),
        "p_base_mean": 0.6,
        "p_cand_mean": 0.6,
        "dp_mean": float(dp.mean()),
        "rms_dp": float(dp.pow(2).mean().sqrt()),
        "n_positions": N,
        "greedy_agree_len": float(N if not kl else rng.integers(5, N)),
        "n_scored": N,
        "prefill_ms": 100.0,
        "prefill_tok_s": base_prefill * (0.9 + 0.3 * speed + rng.random() * 0.05),
        "decode_tok_s": base_decode * speed,
        "decode_ms_per_tok": 1000 / (base_decode * speed),
        "weights_bytes": 270_000_000 // (2 if weights == "int8" else 1),
        "kv_cache_bytes": 1 << 20,
        "peak_mem_bytes": None,
        "calibration_tokens": 2048 if smooth else None,
        "device": "cpu",
        "torch": torch.__version__,
        "git_commit": "abc1234",
        "finished_at": finished,
        "wall_s": 12.0,
    }
    return row, {"kl": kl_pos, "top1_agree": top1, "dp": dp}


def write_runs(root: Path, ctxs=("1k", "8k"), prompt_sets=("edit", "explain"), configs=CONFIGS) -> Path:
    """A runs folder laid out like the sweep's: rows/MODEL/BACKEND/NAME.parquet (+ positions)."""
    rng = np.random.default_rng(0)
    for ctx in ctxs:
        for ps in prompt_sets:
            for q, w, kv, smooth, speed, kl in configs:
                row, pos = fake_row(q, w, kv, smooth, speed, kl, ctx=ctx, prompt_set=ps, rng=rng)
                name = f"{q}-{'smooth' if smooth else 'nosmooth'}-{ctx}-{ps}-0123456789.parquet"
                tables.write_row(root / "rows" / "smollm2-135m" / "reference" / name, row, pos)
    return root


def parse_tables(md: str) -> dict:
    """{(section, subsection): {config: {header: cell}}} of every Markdown table in ``md``."""
    out, section, sub, header = {}, None, None, None
    for line in md.splitlines():
        if line.startswith("## "):
            section, sub = line[3:], None
        elif line.startswith("### "):
            sub = line[4:]
        elif line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cells[0] == "Config":
                header = cells
            else:
                out.setdefault((section, sub), {})[cells[0]] = dict(zip(header, cells))
    return out


def table_of(md: str, ctx: str, prompt_set: str) -> dict:
    tabs = parse_tables(md)
    keys = [k for k in tabs if k[0] == f"smollm2-135m, ctx {ctx}" and k[1] and f"`{prompt_set}`" in k[1]]
    assert len(keys) == 1, (keys, list(tabs))
    return tabs[keys[0]]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    runs = write_runs(tmp_path_factory.mktemp("runs"))
    path = report.render(runs)
    return runs, path, path.read_text()


def test_report_has_a_section_per_group_and_a_table_per_prompt_set(rendered):
    runs, path, md = rendered
    assert path == runs / "report" / "report.md"
    sections = re.findall(r"^## (.*)$", md, flags=re.M)
    assert sections == ["smollm2-135m, ctx 1k", "smollm2-135m, ctx 8k"]
    for ctx in CTX:
        for ps in ("edit", "explain"):
            tab = table_of(md, ctx, ps)
            assert list(tab) == [
                "bf16",
                "int8_weights",
                "int8_kv (smoothed keys)",
                "int8_kv",
                "int8_both (smoothed keys)",
            ]


def test_bf16_is_the_unit_and_int8_ratios_come_from_the_rows(rendered):
    runs, _, md = rendered
    rows = tables.collect(runs / "rows")
    for ctx in CTX:
        for ps in ("edit", "explain"):
            tab = table_of(md, ctx, ps)
            assert tab["bf16"]["Prefill tok/s"].endswith("(1.00×)")
            assert tab["bf16"]["Decode tok/s"].endswith("(1.00×)")
            sel = rows.filter((pl.col("ctx") == ctx) & (pl.col("prompt_set") == ps))
            bf16 = sel.filter(pl.col("quant") == "bf16").row(0, named=True)
            for quant, smooth, label in [
                ("int8_both", True, "int8_both (smoothed keys)"),
                ("int8_kv", False, "int8_kv"),
            ]:
                r = sel.filter((pl.col("quant") == quant) & (pl.col("smooth_keys") == smooth)).row(0, named=True)
                for col, head in [("decode_tok_s", "Decode tok/s"), ("prefill_tok_s", "Prefill tok/s")]:
                    speed, ratio = re.fullmatch(r"([\d,.]+) \(([\d.]+)×\)", tab[label][head]).groups()
                    assert float(speed.replace(",", "")) == pytest.approx(r[col], rel=5e-3, abs=0.5)
                    assert ratio == f"{r[col] / bf16[col]:.2f}"
                    assert col == "prefill_tok_s" or ratio != "1.00"  # int8 decodes faster here
                assert tab[label]["Mean KLD"] == f"{r['kl_mean']:.4g}"
                assert tab[label]["Same top p (%)"] == f"{100 * r['top1_agree']:.2f}"


def test_llama_cpp_labels_are_the_column_names(rendered):
    _, _, md = rendered
    header = next(line for line in md.splitlines() if line.startswith("| Config"))
    for label in [
        "Mean KLD",
        "Median KLD",
        "99.0% KLD",
        "99.9% KLD",
        "Maximum KLD",
        "RMS Δp (%)",
        "Same top p (%)",
        "Mean PPL(base)",
        "Mean PPL(Q)",
        "Greedy agree len",
    ]:
        assert label in header


def test_plots_are_png_files_linked_from_the_report(rendered):
    runs, path, md = rendered
    links = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", md)
    scatters = [f for f in links if f.startswith("scatter-")]
    positions = [f for f in links if f.startswith("kl_by_position-")]
    assert len(scatters) == 2 and len(positions) == 4 and len(set(links)) == len(links)
    for f in links:
        data = (path.parent / f).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000
    assert sorted(p.name for p in path.parent.glob("*.png")) == sorted(links)
    assert (path.parent / "summary.parquet").is_file() and (path.parent / "summary.md").is_file()
    assert len(pl.read_parquet(path.parent / "summary.parquet")) == 2 * 2 * len(CONFIGS)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp files left


def test_missing_bf16_and_missing_positions_are_notes(tmp_path):
    runs = write_runs(tmp_path, ctxs=("8k",), prompt_sets=("edit",))
    rows_dir = runs / "rows" / "smollm2-135m" / "reference"
    for p in rows_dir.glob("bf16-*"):
        p.unlink()
    (rows_dir / "int8_kv-nosmooth-8k-edit-0123456789.positions.parquet").unlink()
    md = report.render(runs, tmp_path / "out").read_text()
    tab = table_of(md, "8k", "edit")
    assert "bf16" not in tab and not any("×" in cell for r in tab.values() for cell in r.values())
    assert re.fullmatch(r"[\d,.]+", tab["int8_kv"]["Decode tok/s"])
    assert "without ratios" in md
    assert "int8_kv: no positions file" in md
    assert re.search(r"!\[[^\]]*\]\(kl_by_position-[^)]+\.png\)", md)  # the other lines still drawn


def test_a_group_of_bf16_rows_only_still_renders(tmp_path):
    runs = write_runs(tmp_path, ctxs=("8k",))
    for p in (runs / "rows" / "smollm2-135m" / "reference").glob("int8*"):
        p.unlink()
    md = report.render(runs, tmp_path / "out").read_text()
    assert "bf16" in table_of(md, "8k", "edit")


def test_kl_estimate_column_newest_duplicate_and_foreign_parquet(tmp_path):
    runs = write_runs(tmp_path, ctxs=("1k",), prompt_sets=("edit",), configs=CONFIGS[:2])
    pl.DataFrame({"metric": ["kl_mean"], "limit": [0.01]}).write_parquet(runs / "baseline.parquet")
    rng = np.random.default_rng(1)
    row, pos = fake_row(*CONFIGS[1], ctx="1k", prompt_set="edit", rng=rng, finished="2025-06-01T00:00:00+00:00")
    row["kl_estimate"], row["kl_mean"] = "topk64+tail", 0.123456
    tables.write_row(runs / "rows" / "x" / "newer.parquet", row, pos)
    md = report.render(runs).read_text()
    tab = table_of(md, "1k", "edit")
    assert tab["int8_weights"]["Mean KLD"] == "0.1235"
    assert tab["int8_weights"]["KL estimate"] == "topk64+tail"
    assert "1 older row(s)" in md
    assert re.findall(r"^## (.*)$", md, flags=re.M) == ["smollm2-135m, ctx 1k"]  # not a "None" section


def test_rows_of_another_scoring_window_get_their_own_section(tmp_path):
    runs = write_runs(tmp_path, ctxs=("1k",), prompt_sets=("edit",), configs=CONFIGS[:2])
    rng = np.random.default_rng(2)
    for cfg in CONFIGS[:2]:
        row, pos = fake_row(*cfg, ctx="1k", prompt_set="edit", rng=rng)
        row["n_score"] = 64
        tables.write_row(runs / "rows" / "n64" / f"{cfg[0]}.parquet", row, pos)
    md = report.render(runs).read_text()
    sections = re.findall(r"^## (.*)$", md, flags=re.M)
    assert sorted(sections) == ["smollm2-135m, ctx 1k, n_score 64", "smollm2-135m, ctx 1k, n_score ?"]
    assert "older row" not in md


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tileinfer.report", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )


def test_command_line_writes_the_report_and_rejects_an_empty_folder(rendered, tmp_path):
    runs, _, _ = rendered
    out = run_cli(runs, "--out", tmp_path / "cli")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "cli" / "report.md").is_file() and list((tmp_path / "cli").glob("scatter-*.png"))
    (tmp_path / "empty").mkdir()
    out = run_cli(tmp_path / "empty")
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith("tileinfer.report: error: no result rows")
    assert not (tmp_path / "empty" / "report").exists()


def test_degenerate_windows_are_flagged_and_rows_without_the_measure_are_unknown(tmp_path, capsys):
    runs = write_runs(tmp_path, ctxs=("1k",), prompt_sets=("explain",), configs=CONFIGS[:3])
    rows_dir = runs / "rows" / "smollm2-135m" / "reference"
    # bf16 degenerate (80% of the reply repeats), int8_weights measured and fine, int8_kv written before the measure
    for prefix, frac in [("bf16-", 0.8), ("int8_weights-", 0.1)]:
        (f,) = rows_dir.glob(f"{prefix}*[0-9].parquet")
        tables.atomic_parquet(
            pl.read_parquet(f).with_columns(reply_repeat_frac=pl.lit(frac), degenerate=pl.lit(frac > 0.5)), f
        )
    md = report.render(runs).read_text()
    warning = [line for line in md.splitlines() if line.startswith("**Warning:**")]
    assert len(warning) == 1 and warning[0].endswith(
        "degenerate window (over 50% of the reply repeats an earlier "
        "4-gram, so their KL understates the drift): "
        "smollm2-135m/bf16/1k/explain/reference"
    )
    tab = table_of(md, "1k", "explain")
    assert tab["bf16"]["Reply repetition"] == "**80%, degenerate**"
    assert tab["int8_weights"]["Reply repetition"] == "10%"
    assert tab["int8_kv (smoothed keys)"]["Reply repetition"] == "?"  # unknown, not degenerate
    assert "warning: 1 row(s) scored a degenerate window" in capsys.readouterr().out
