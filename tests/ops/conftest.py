"""The op conformance suites: one file per op family, each test run on every backend ("target").

Targets:

- ``triton-interpret``: the Triton kernels in Triton's interpreter on the CPU (tests/conftest.py
  sets TRITON_INTERPRET=1 where there is no GPU); CI runs these, on small shapes.
- ``triton``, ``cutile``: the compiled kernels on a CUDA GPU, marked ``gpu`` (on the H200:
  ``pytest -m gpu tests/ops``), at the registered models' shapes (tests/numerics.py).
- ``reference``: the ground truth itself, only where a test says so (the fallback contract).

A test names its cases with ``@pytest.mark.cases(argnames, small=[...], model=[...])`` (tuples of
values, or ``pytest.param(..., id=...)`` for a readable id; or a dict of such lists by target):
the interpreter (and the reference) runs the ``small`` ones, each GPU target the ``model`` ones
(``targets=`` narrows the targets, for tests of one backend's internals). A backend conforms
when every suite passes with it; a new one joins by being added to :data:`TARGETS` and
:func:`target`.

Every test here starts with ``torch.empty`` poisoned (an output element no kernel wrote fails the
comparison), with inputs from a seed of its own (:func:`seed_of`, fixed per test), and fails if an
op of its target fell back to the reference (``Backend.fallbacks()``) unless it requests
``fallback_expected`` and checks them itself.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import pytest
import torch

from tileinfer.ops import Backend, get_backend

ParameterSet = type(pytest.param())  # what pytest.param returns

INTERPRET = "triton-interpret"
GPU_TARGETS = ("triton", "cutile")
TARGETS = (INTERPRET, *GPU_TARGETS)


@dataclass(frozen=True)
class Target:
    """A backend under test: ``ops`` (a new Backend for each test), the device its tensors live on,
    and its name."""

    name: str
    ops: Backend
    device: str

    @property
    def backend(self) -> str:
        """The name it records fallbacks under (``Backend.name``)."""
        return "triton" if self.name == INTERPRET else self.name


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cases(argnames, small=(), model=(), targets=TARGETS): the test's cases per target tier "
        "(tests/ops/conftest.py)",
    )


def pytest_generate_tests(metafunc):
    """Parametrize ``target`` (and the ``cases`` marker's arguments) over the targets: the small
    cases with the interpreter, the model cases with each GPU target (marked ``gpu``)."""
    if "target" not in metafunc.fixturenames:
        return
    mark = metafunc.definition.get_closest_marker("cases")
    assert mark is not None, f"{metafunc.function.__name__} takes a target: give it @pytest.mark.cases(...)"
    argnames = mark.args[0] if mark.args else ""
    small, model = mark.kwargs.get("small", ()), mark.kwargs.get("model", ())
    targets = mark.kwargs.get("targets", TARGETS)
    names = [n.strip() for n in argnames.split(",") if n.strip()]
    params = []
    for t in targets:
        cases = small if t in (INTERPRET, "reference") else model
        for case in cases.get(t, ()) if isinstance(cases, dict) else cases:
            if isinstance(case, ParameterSet):  # pytest.param(..., id=...): values with a readable id
                values, case_id = case.values, case.id
            else:
                values = case if isinstance(case, tuple) else (case,)
                case_id = "-".join(map(str, values))
            assert len(values) == len(names), (metafunc.function.__name__, values, names)
            params.append(
                pytest.param(
                    t,
                    *values,
                    id="-".join(filter(None, [t, case_id])),
                    marks=[pytest.mark.gpu] if t in GPU_TARGETS else [],
                )
            )
    metafunc.parametrize(["target", *names], params, indirect=["target"])


@pytest.fixture
def target(request) -> Target:
    """The backend named by the test's parameter; skipped where it cannot run (the interpreter only
    without a GPU, the compiled backends only with one)."""
    name = request.param
    if name == "reference":
        return Target(name, get_backend("reference"), "cpu")
    if name == INTERPRET:
        if torch.cuda.is_available():
            pytest.skip("the interpreter runs where there is no GPU (the compiled Triton target runs here)")
        pytest.importorskip("triton")
        assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET=1 without a GPU"
        return Target(name, get_backend("triton"), "cpu")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if name == "triton":
        pytest.importorskip("triton")
        from tileinfer.ops.triton._common import INTERPRET as interpreting

        assert not interpreting, "TRITON_INTERPRET is set: run the GPU tests in their own pytest process"
    else:
        pytest.importorskip("cuda.tile")
    return Target(name, get_backend(name), "cuda")


_empty = torch.empty


def _poisoned_empty(*size, **kw):
    t = _empty(*size, **kw)
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(-77 if t.dtype != torch.uint8 else 77)
    return t


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """Every torch.empty starts as NaN (floats) or -77 (integers): outputs, workspaces, KV pools; an
    element a kernel never writes fails the comparison with the reference."""
    monkeypatch.setattr(torch, "empty", _poisoned_empty)


def seed_of(name: str) -> int:
    """The seed of the test named ``name``: the CRC-32 of the name and ``TILEINFER_TEST_SEED`` (default 0),
    the same on every run and machine (``hash()`` changes with each run's hash randomisation, so a
    failure could not be replayed); set ``TILEINFER_TEST_SEED`` to draw other inputs."""
    return zlib.crc32(f"{os.environ.get('TILEINFER_TEST_SEED', '0')}:{name}".encode()) % 2**31


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Seed torch with :func:`seed_of` of the test's name: one stream per test, its own inputs for
    every test, replayable; a failing test's report names the seed (section "seed")."""
    seed = seed_of(request.node.name)
    request.node.add_report_section(
        "call", "seed", f"torch.manual_seed({seed}); TILEINFER_TEST_SEED={os.environ.get('TILEINFER_TEST_SEED', '0')}"
    )
    torch.manual_seed(seed)


@pytest.fixture
def fallback_expected():
    """Requested by a test that makes ops fall back on purpose (it checks ``target.ops.fallbacks()``
    itself)."""


@pytest.fixture(autouse=True)
def kernels_only(request):
    """Fail a test in which an op of its target quietly ran the reference instead of the kernels."""
    watch = "target" in request.fixturenames and "fallback_expected" not in request.fixturenames
    ops = request.getfixturevalue("target").ops if watch else None
    yield
    if ops is not None:
        assert ops.fallbacks() == [], "ops fell back to the reference; the test measured torch for them"
