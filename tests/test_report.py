"""The sweep report on a synthetic runs folder (no model runs): tables, speed ratios, plots, errors."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from evals import intervals
from tileinfer import report
from tileinfer.jobs import tables
from tileinfer.jobs.rows import atomic_parquet, read, write_row

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
    """A plausible row as :func:`tileinfer.jobs.rows.make_row` builds it, and its per-position arrays."""
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


def collect(folder: Path) -> pl.DataFrame:
    """Every row under ``folder`` as one table, as the sweep reads them."""
    return read(folder).drop("row_file")


def write_runs(root: Path, ctxs=("1k", "8k"), prompt_sets=("edit", "explain"), configs=CONFIGS) -> Path:
    """A runs folder laid out like the sweep's: rows/MODEL/BACKEND/NAME.parquet (+ positions)."""
    rng = np.random.default_rng(0)
    for ctx in ctxs:
        for ps in prompt_sets:
            for q, w, kv, smooth, speed, kl in configs:
                row, pos = fake_row(q, w, kv, smooth, speed, kl, ctx=ctx, prompt_set=ps, rng=rng)
                name = f"{q}-{'smooth' if smooth else 'nosmooth'}-{ctx}-{ps}-0123456789.parquet"
                write_row(root / "rows" / "smollm2-135m" / "reference" / name, row, pos)
    return root


def parse_tables(md: str) -> dict:
    """{(section, subsection): {config: {header: cell}}} of every Markdown table in ``md``."""
    out, section, sub, header = {}, None, None, None
    for line in md.splitlines():
        if line.startswith("## "):
            section, sub = line[3:], None
        elif line.startswith("### "):
            sub = line[4:]
        elif line.startswith("#### llama.cpp"):  # the ± 1σ figures: a table of their own
            sub = line[5:]
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
    assert sections == ["smollm2-135m, ctx 1k", "smollm2-135m, ctx 8k", "Paired differences"]
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
    rows = collect(runs / "rows")
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
    # short names: model, ctx, backend (and scored set); no hash where the sections differ in nothing else
    assert scatters == ["scatter-smollm2_135m-1k-reference.png", "scatter-smollm2_135m-8k-reference.png"]
    assert positions == [
        f"kl_by_position-smollm2_135m-{ctx}-reference-{ps}.png" for ctx in CTX for ps in ("edit", "explain")
    ]
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
    (rows_dir / "int8_weights-nosmooth-8k-edit-0123456789.positions.parquet").write_bytes(b"damaged")
    md = report.render(runs, tmp_path / "out").read_text()
    tab = table_of(md, "8k", "edit")
    assert "bf16" not in tab and not any("×" in cell for r in tab.values() for cell in r.values())
    assert re.fullmatch(r"[\d,.]+", tab["int8_kv"]["Decode tok/s"])
    assert "without ratios" in md
    for config, quant in (("int8_kv", "int8_kv"), ("int8_weights", "int8_weights")):  # missing, damaged
        f = f"{quant}-nosmooth-8k-edit-0123456789.positions.parquet"
        assert f"{config}: no readable positions file ({f}), line skipped." in md
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
    write_row(runs / "rows" / "x" / "newer.parquet", row, pos)
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
        write_row(runs / "rows" / "n64" / f"{cfg[0]}.parquet", row, pos)
    md = report.render(runs).read_text()
    sections = re.findall(r"^## (.*)$", md, flags=re.M)
    assert sorted(sections) == ["smollm2-135m, ctx 1k, n_score 64", "smollm2-135m, ctx 1k, n_score ?"]
    assert "older row" not in md
    # plots of sections that differ in another setting: model, ctx, backend and a short hash of the rest
    links = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", md)
    scatters = [f for f in links if f.startswith("scatter-")]
    hashes = [re.fullmatch(r"scatter-smollm2_135m-1k-reference-([0-9a-f]{6})\.png", f)[1] for f in scatters]
    assert len(set(hashes)) == 2
    assert [f for f in links if f.startswith("kl_by_position-")] == [
        f"kl_by_position-smollm2_135m-1k-reference-{h}-edit.png" for h in hashes
    ]
    assert sorted(p.name for p in (runs / "report").glob("*.png")) == sorted(links)


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
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith("tileinfer.report: error: no result rows")
    assert not (tmp_path / "empty" / "report").exists()


def test_degenerate_windows_are_flagged_and_rows_without_the_measure_are_unknown(tmp_path, capsys):
    runs = write_runs(tmp_path, ctxs=("1k",), configs=CONFIGS[:3])
    rows_dir = runs / "rows" / "smollm2-135m" / "reference"
    # explain: bf16 degenerate (80% of the reply repeats), int8_weights measured and fine, int8_kv written
    # before the measure; edit: all written before it
    for prefix, frac in [("bf16-", 0.8), ("int8_weights-", 0.1)]:
        (f,) = rows_dir.glob(f"{prefix}*-explain-*[0-9].parquet")
        atomic_parquet(
            pl.read_parquet(f).with_columns(reply_repeat_frac=pl.lit(frac), degenerate=pl.lit(frac > 0.5)), f
        )
    md = report.render(runs).read_text()
    lines = md.splitlines()
    warnings = [i for i, line in enumerate(lines) if line.startswith("**Warning:**")]
    note = (
        "**Warning:** 1 row(s) scored a degenerate window (over 50% of the reply repeats an earlier "
        "4-gram, so their KL understates the drift): smollm2-135m/bf16/1k/explain/reference"
    )
    # named once for the report, above its first section, and again under the table of its scored set
    assert [lines[i] for i in warnings] == [note, note]
    explain = next(i for i, line in enumerate(lines) if line.startswith("### Prompt set `explain`"))
    assert warnings[0] < lines.index("## smollm2-135m, ctx 1k") < explain < warnings[1]
    assert not any(line.startswith("#") for line in lines[explain + 1 : warnings[1]])  # explain's own part
    tab = table_of(md, "1k", "explain")
    assert tab["bf16"]["Reply repetition"] == "**80%, degenerate**"
    assert tab["int8_weights"]["Reply repetition"] == "10%"
    assert tab["int8_kv (smoothed keys)"]["Reply repetition"] == "?"  # unknown, not degenerate
    assert table_of(md, "1k", "edit")["bf16"]["Reply repetition"] == "?"
    assert capsys.readouterr().out.count("warning: 1 row(s) scored a degenerate window") == 1


# Speculative decoding rows: (quant config index in CONFIGS, spec, k, settings, acceptance rate, mean acceptance
# length, speed-up, exact, first mismatch, its margin); beside the plain rows of CONFIGS[:3] at ctx 1k.
SPECS = [
    (0, "ngram", 4, "min_n=3,max_n=5", 0.5, 2.2, 1.4, True, None, None),
    (0, "draft", 5, "draft=smollm2-135m@0123456789ab,quant=bf16", 0.7, 3.1, 1.9, False, 17, 0.03),
    (1, "ngram", 4, "min_n=3,max_n=5", 0.45, 1.9, 1.25, False, 3, 2.5),
    (1, "dflash", 7, "dflash=/models/drafter", 0.01, 1.05, 0.6, True, None, None),
]
SPEC_CTX = "1k"


def spec_row(cfg, spec, k, settings, rate, length, speedup, exact, step, margin, *, prompt_set, rng):
    """A row of a job with speculative decoding (:func:`evals.speculation.columns`), and its positions."""
    row, pos = fake_row(*CONFIGS[cfg], ctx=SPEC_CTX, prompt_set=prompt_set, rng=rng)
    drafts = 40
    accepted = round((length - 1) * drafts)
    return row | {
        "spec": spec,
        "spec_k": k,
        "spec_settings": settings,
        "spec_temperature": 0.0,
        "spec_drafts": drafts,
        "spec_drafted_tokens": round(accepted / rate),
        "spec_accepted_tokens": accepted,
        "spec_acceptance_rate": rate,
        "spec_acceptance_length": length,
        "spec_tokens_per_forward": 0.9 * length,
        "spec_acceptance_at": [rate**0.5 * 0.9**i for i in range(k)],
        "spec_histogram": [drafts // (k + 1)] * (k + 1),
        "spec_draft_ms": 1.5 * k,
        "spec_verify_ms": 21.0,
        "spec_decode_tok_s": row["decode_tok_s"] * speedup,
        "spec_speedup": speedup,
        "spec_exact": exact,
        "spec_first_mismatch": step,
        "spec_mismatch_margin": margin,
    }, pos


def write_spec_runs(root: Path, specs=SPECS) -> Path:
    """``write_runs`` (plain rows of ctx 1k and 8k) plus speculative rows at ctx 1k for both prompt sets."""
    write_runs(root, configs=CONFIGS[:3])
    rng = np.random.default_rng(3)
    for ps in ("edit", "explain"):
        for spec in specs:
            row, pos = spec_row(*spec, prompt_set=ps, rng=rng)
            write_row(root / "rows" / "spec" / f"{row['quant']}-{spec[1]}-{SPEC_CTX}-{ps}.parquet", row, pos)
    return root


def spec_tables(md: str) -> dict:
    """{(section, prompt set): {(config, proposer): {header: cell}}} of the speculative decoding tables."""
    out, section, ps, header = {}, None, None, None
    for line in md.splitlines():
        if line.startswith("## "):
            section, ps = line[3:], None
        elif line.startswith("### "):
            ps = None
        elif line.startswith("#### "):
            ps = re.search(r"`([^`]+)`", line)[1]
        elif ps and line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cells[0] == "Config":
                header = cells
            else:
                out.setdefault((section, ps), {})[cells[0], cells[1].split(" ")[0]] = dict(zip(header, cells))
    return out


@pytest.fixture(scope="module")
def spec_rendered(tmp_path_factory):
    runs = write_spec_runs(tmp_path_factory.mktemp("spec_runs"))
    path = report.render(runs)
    return runs, path, path.read_text()


def test_speculative_section_has_a_line_per_proposer_with_the_rows_numbers(spec_rendered):
    runs, _, md = spec_rendered
    assert re.findall(r"^## (.*)$", md, flags=re.M) == ["smollm2-135m, ctx 1k", "smollm2-135m, ctx 8k"]
    assert md.count("### Speculative decoding") == 1  # ctx 8k has plain rows only
    assert md.index("### Speculative decoding") < md.index("## smollm2-135m, ctx 8k")
    assert md.count(report.DFLASH_NOTE) == 1
    rows = collect(runs / "rows").filter(pl.col("ctx") == SPEC_CTX)
    tabs = spec_tables(md)
    assert sorted(tabs) == [("smollm2-135m, ctx 1k", "edit"), ("smollm2-135m, ctx 1k", "explain")]
    for ps in ("edit", "explain"):
        tab = tabs["smollm2-135m, ctx 1k", ps]
        assert list(tab) == [  # per configuration: the plain baseline, then ngram, draft, dflash
            ("bf16", "none"),
            ("bf16", "ngram"),
            ("bf16", "draft"),
            ("int8_weights", "none"),
            ("int8_weights", "ngram"),
            ("int8_weights", "dflash"),
            ("int8_kv (smoothed keys)", "none"),
        ]
        plain = rows.filter((pl.col("prompt_set") == ps) & (pl.col("spec") == "none") & (pl.col("quant") == "bf16"))
        line = tab["bf16", "none"]
        assert line["Proposer"] == "none (plain)" and line["Speed-up (×)"] == "1 (plain)"
        assert float(line["Plain decode tok/s"]) == pytest.approx(plain["decode_tok_s"][0], rel=5e-3)
        assert line["Speculative tok/s"] == line["Exact (greedy reply = plain)"] == "–"
        for cfg, spec, k, settings, rate, length, speedup, *_ in SPECS:
            quant = CONFIGS[cfg][0]
            r = rows.filter((pl.col("prompt_set") == ps) & (pl.col("spec") == spec) & (pl.col("quant") == quant))
            r = r.row(0, named=True)
            line = tab[quant, spec]
            assert line["Proposer"] == f"{spec} {quant}/k={k} ({settings})" and line["k"] == str(k)
            assert line["Acceptance rate (%)"] == f"{100 * rate:.1f}"
            assert line["Mean acceptance length"] == f"{length:.2f}"
            assert line["Tokens per target forward"] == f"{0.9 * length:.2f}"
            assert line["Speed-up (×)"] == f"{speedup:.2f}"
            assert float(line["Plain decode tok/s"]) == pytest.approx(r["decode_tok_s"], rel=5e-3)
            assert float(line["Speculative tok/s"]) == pytest.approx(r["spec_decode_tok_s"], rel=5e-3)
            assert line["Draft ms/step"] == f"{1.5 * k:.3g}" and line["Verify ms/step"] == "21"
        exact = {key: line["Exact (greedy reply = plain)"] for key, line in tab.items()}
        assert exact["bf16", "ngram"] == exact["int8_weights", "dflash"] == "yes"
        assert exact["bf16", "draft"] == "no at step 17, margin 0.03: near-tie"
        assert exact["int8_weights", "ngram"] == "**no at step 3, margin 2.5: MISMATCH**"
    warning = [line for line in md.splitlines() if "MISMATCH" in line and line.startswith("**Warning:**")]
    assert warning == [
        "**Warning:** 2 speculative row(s) left the plain greedy reply beyond a near-tie (MISMATCH): "
        "smollm2-135m/int8_weights/1k/edit/reference/ngram, smollm2-135m/int8_weights/1k/explain/reference/ngram"
    ]


def test_drift_tables_show_each_configuration_once_from_its_plain_row(spec_rendered):
    runs, _, md = spec_rendered
    rows = collect(runs / "rows")
    for ps in ("edit", "explain"):
        tab = table_of(md, SPEC_CTX, ps)
        assert list(tab) == ["bf16", "int8_weights", "int8_kv (smoothed keys)"]
        plain = rows.filter(
            (pl.col("ctx") == SPEC_CTX)
            & (pl.col("prompt_set") == ps)
            & (pl.col("quant") == "int8_weights")
            & (pl.col("spec") == "none")
        )
        assert tab["int8_weights"]["Mean KLD"] == f"{plain['kl_mean'][0]:.4g}"
        assert tab["int8_weights"]["Decode tok/s"].startswith(f"{plain['decode_tok_s'][0]:.3g} (")
    assert "no plain (spec=none) row" not in md


def test_speculative_plots_are_png_files_linked_from_the_report(spec_rendered):
    _, path, md = spec_rendered
    links = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", md)
    spec = [f for f in links if f.startswith("spec_")]
    assert spec == ["spec_speedup-smollm2_135m-1k-reference.png", "spec_acceptance-smollm2_135m-1k-reference.png"]
    assert md.index(report.DFLASH_NOTE) < md.index(spec[0]) < md.index("## smollm2-135m, ctx 8k")
    for f in spec:
        data = (path.parent / f).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000
    assert sorted(p.name for p in path.parent.glob("*.png")) == sorted(links)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp files left
    summary = (path.parent / "summary.md").read_text()
    assert "spec_speedup" in summary and "1.25" in summary  # the summary shows speculation where there is some


def test_old_rows_without_spec_columns_report_without_the_section(tmp_path):
    runs = write_runs(tmp_path / "old", ctxs=("1k",), prompt_sets=("edit",), configs=CONFIGS[:2])
    for f in (runs / "rows").rglob("*[0-9].parquet"):
        atomic_parquet(pl.read_parquet(f).drop("spec"), f)
    md = report.render(runs).read_text()
    assert list(table_of(md, "1k", "edit")) == ["bf16", "int8_weights"]
    assert "Speculative decoding" not in md and "MISMATCH" not in md and report.DFLASH_NOTE not in md
    assert not list((runs / "report").glob("spec_*"))
    assert "spec" not in (runs / "report" / "summary.md").read_text()
    # mixed with rows of speculative decoding (concatenated diagonally): the section appears
    rng = np.random.default_rng(4)
    row, pos = spec_row(*SPECS[0], prompt_set="edit", rng=rng)
    write_row(runs / "rows" / "spec" / "bf16-ngram.parquet", row, pos)
    row, pos = spec_row(4, *SPECS[2][1:], prompt_set="edit", rng=rng)  # int8_both: no plain row
    write_row(runs / "rows" / "spec" / "int8_both-ngram.parquet", row, pos)
    md = report.render(runs).read_text()
    assert list(table_of(md, "1k", "edit")) == ["bf16", "int8_weights", "int8_both (smoothed keys)"]
    assert "no plain (spec=none) row of int8_both (smoothed keys) (spec=ngram)" in md
    tab = spec_tables(md)["smollm2-135m, ctx 1k", "edit"]
    assert list(tab) == [
        ("bf16", "none"),
        ("bf16", "ngram"),
        ("int8_weights", "none"),
        ("int8_both (smoothed keys)", "ngram"),
    ]
    assert tab["bf16", "ngram"]["Speed-up (×)"] == "1.40"
    assert tab["int8_both (smoothed keys)", "ngram"]["Exact (greedy reply = plain)"].endswith("MISMATCH**")
    assert len(list((runs / "report").glob("spec_*.png"))) == 2


def test_printed_table_with_speculative_rows_keeps_to_120_characters(tmp_path, capsys):
    runs = write_spec_runs(tmp_path / "runs")
    df = collect(runs / "rows")
    df = df.with_columns(reply_repeat_frac=pl.lit(0.1), degenerate=pl.lit(False))
    tables.print_table(df)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(map(len, lines)) <= tables.PRINT_WIDTH, out
    header = re.split(r"\s*[│┆]\s*", lines[2].strip("│ "))
    assert header == [
        "quant",
        "ctx",
        "prompt_set",
        "kl_mean",
        "decode_tok_s",
        "spec",
        "spec_k",
        "acc_len",
        "speedup",
        "exact",
        "repeat",
    ]
    body = [re.split(r"\s*┆\s*", line.strip("│ ")) for line in lines[4:] if "┆" in line]
    assert len(body) == len(df)  # one line per row, no cell wrapped
    cells = {(b[0], b[1], b[2], b[5]): b for b in body}
    assert cells["bf16", "1k", "edit", "none"][6:10] == ["", "", "", ""]
    assert cells["bf16", "1k", "edit", "ngram"][6:10] == ["4", "2.20", "1.40", "yes"]
    assert cells["bf16", "1k", "edit", "draft"][6:10] == ["5", "3.10", "1.90", "tie@17"]
    assert cells["int8_weights", "1k", "explain", "ngram"][6:10] == ["4", "1.90", "1.25", "NO@3"]
    spec_order = [b[5] for b in body if b[:3] == ["int8_weights", "1k", "edit"]]
    assert spec_order == ["none", "ngram", "dflash"]
    warning = [line for line in lines if line.startswith("warning:")]
    assert len(warning) == 1
    assert warning[0].startswith("warning: 2 speculative row(s) parted from the plain greedy reply")
    # without speculation the layout is the plain one
    tables.print_table(df.filter(pl.col("spec") == "none"))
    assert "acc_len" not in capsys.readouterr().out


def test_corpus_rows_show_intervals_sigmas_and_paired_differences(tmp_path):
    rng = np.random.default_rng(2)
    for q, w, kv, smooth, speed, kl in CONFIGS:
        row, pos = fake_row(q, w, kv, smooth, speed, kl, ctx="1k", prompt_set="pydoc", rng=rng)
        group = torch.arange(N) // (N // 4)  # four windows
        logp = {"logp_base": -torch.rand(N), "logp_cand": -torch.rand(N)}
        row |= intervals.row_intervals(pos | logp, group, "window") | {"corpus": "pydoc", "n_windows": 4}
        name = f"{q}-{'smooth' if smooth else 'nosmooth'}-1k-pydoc.parquet"
        write_row(tmp_path / "rows" / "smollm2-135m" / "reference" / name, row, pos | logp | {"group": group})
    md = report.render(tmp_path).read_text()
    assert f"### Corpus `pydoc` (4 window(s), {N} scored positions)" in md
    rows = collect(tmp_path / "rows")
    r = rows.filter((pl.col("quant") == "int8_kv") & pl.col("smooth_keys")).row(0, named=True)
    tab = table_of(md, "1k", "pydoc")
    assert (
        tab["int8_kv (smoothed keys)"]["Mean KLD"]
        == f"{r['kl_mean']:.4g} [{r['kl_mean_lo']:.4g}, {r['kl_mean_hi']:.4g}]"
    )
    top1 = f"{100 * r['top1_agree']:.2f} [{100 * r['top1_agree_lo']:.2f}, {100 * r['top1_agree_hi']:.2f}]"
    assert tab["int8_kv (smoothed keys)"]["Same top p (%)"] == top1
    # 4 windows of 24: 8 blocks of ceil(24 ** (1/3)) each
    assert "BCa bootstrap over the scored set's units (block of 3 positions (32): unit, and how many" in md
    assert f"{r['kl_mean']:.4g} ± {r['kl_mean_sigma']:.4g}" in md  # llama.cpp's figures, in their own table
    # key smoothing, position by position on the same windows: smoothed minus unsmoothed
    pos = {
        s: pl.read_parquet(next((tmp_path / "rows").rglob(f"int8_kv-{s}-1k-pydoc.positions.parquet")))["kl"].to_numpy()
        for s in ("smooth", "nosmooth")
    }
    d, lo, hi = intervals.paired_difference(pos["smooth"], pos["nosmooth"], np.arange(N) // (N // 4))
    line = next(ln for ln in md.splitlines() if ln.startswith("| key smoothing") and "int8_kv (smoothed keys)" in ln)
    assert f"{d:.4g} [{lo:.4g}, {hi:.4g}]" in line and d < 0
