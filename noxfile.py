"""Every job of the pc monorepo: `nox -s tests | lint | typecheck | demo | bench | docs | gpu`.

Sessions install the local packages together, editable, so internal
dependencies (pc-zero -> pc-chunk -> pc-comm ...) resolve from this checkout.
torch is pinned through constraints/cpu.txt for CPU machines; set
PC_CONSTRAINTS=<file> to use other pins, or PC_CONSTRAINTS= (empty) for none.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
# Bottom layer first: the order tests run and packages install in.
PACKAGES = [
    "pc-comm",
    "pc-offload",
    "pc-chunk",
    "pc-zero",
    "pc-pipeline",
    "pc-tensor",
    "pc-booster",
]
INTEGRATION = "integration"
# datasets: pc-train reads save_to_disk directories; the test of that needs it.
TEST_DEPS = ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6", "datasets>=2.14"]

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_venv = "yes"


def _constraints(session: nox.Session) -> list[str]:
    value = os.environ.get("PC_CONSTRAINTS")
    if value == "":
        return []
    path = Path(value) if value else ROOT / "constraints" / "cpu.txt"
    if not path.is_file():
        session.error(
            f"PC_CONSTRAINTS points to {path}, which is not a file. Set it to a pip "
            "constraints file, or to an empty string to install without constraints."
        )
    return ["-c", str(path)]


def _install_workspace(session: nox.Session, *extra: str) -> None:
    """All packages editable in one pip call, plus ``extra`` requirements."""
    editable: list[str] = []
    for package in PACKAGES:
        spec = f"packages/{package}[hf,train]" if package == "pc-booster" else f"packages/{package}"
        editable += ["-e", spec]
    session.install(*_constraints(session), *editable, *extra)


def _split_targets(session: nox.Session) -> tuple[list[str], list[str]]:
    """`nox -s tests -- pc-comm -k collectives`: package names, then pytest args."""
    known = [*PACKAGES, INTEGRATION]
    targets = [arg for arg in session.posargs if arg in known]
    rest = [arg for arg in session.posargs if arg not in known]
    unknown = [arg for arg in rest if arg.startswith("pc-")]
    if unknown:
        session.error(f"unknown package(s) {unknown}; expected some of {known}.")
    return targets or known, rest


@nox.session
def tests(session: nox.Session) -> None:
    """Run the tests of every package and the integration tests, or of the
    packages named after `--` (e.g. `nox -s tests -- pc-comm`)."""
    targets, pytest_args = _split_targets(session)
    _install_workspace(session, *TEST_DEPS)
    for target in targets:
        path = "integration_tests" if target == INTEGRATION else f"packages/{target}/tests"
        session.log(f"--- {target}")
        # Exit code 5 means "no tests collected": a package that is still a
        # skeleton passes, and says so in the log.
        # The slowest tests are listed, so a CI log shows where the time went.
        session.run(
            "python", "-m", "pytest", path, "-m", "not gpu", "--durations=8", *pytest_args,
            success_codes=[0, 5],
        )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on each package's sources and tests, one package at a time."""
    _install_workspace(session, "mypy>=1.10", "nox", *TEST_DEPS)
    targets, _ = _split_targets(session)
    for target in targets:
        if target == INTEGRATION:
            session.run("mypy", "integration_tests", "noxfile.py", "benchmarks", "tools")
            continue
        session.log(f"--- {target}")
        paths = [f"packages/{target}/src"]
        if any((ROOT / "packages" / target / "tests").glob("*.py")):
            paths.append(f"packages/{target}/tests")
        session.run("mypy", *paths)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: pc-train with its defaults (a small GPT-2 on 2 local CPU
    processes). Arguments after `--` go to pc-train."""
    _install_workspace(session)
    session.run("pc-train", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks against the real peers, side by side; tables go to stdout
    and bench-results/. DeepSpeed (a peer of pc-zero) runs ZeRO on the CPU
    with gloo; its first start compiles a small C++ op (g++, about 90 s)."""
    _install_workspace(session, "deepspeed")
    session.env["DS_ACCELERATOR"] = "cpu"
    for script in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        session.run("python", str(script), *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Run every example in docs/, then build the site into site/."""
    _install_workspace(session, "mkdocs>=1.6")
    session.run("python", "tools/run_doc_examples.py", "docs")
    session.run("mkdocs", "build", "--strict")


@nox.session(venv_backend="none")
def bench_gpu(session: nox.Session) -> None:
    """The GPU benchmarks (benchmarks/gpu_*.py), in the current interpreter,
    on a GPU machine: activation offload on GPT-2 medium, the all-reduce of
    CUDA tensors through the host, and the largest model per GPU."""
    sources = os.pathsep.join(str(ROOT / "packages" / p / "src") for p in PACKAGES)
    env = {"PYTHONPATH": sources + os.pathsep + os.environ.get("PYTHONPATH", "")}
    session.run("python", "benchmarks/gpu_offload.py", env=env)
    session.run("python", "benchmarks/gpu_staging.py", env=env)
    session.run("python", "benchmarks/gpu_largest_model.py", "search", env=env)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """Tests marked `gpu`, in the current interpreter (a GPU machine's CUDA
    torch; such machines are often offline, so nothing is installed)."""
    sources = os.pathsep.join(str(ROOT / "packages" / p / "src") for p in PACKAGES)
    env = {"PYTHONPATH": sources + os.pathsep + os.environ.get("PYTHONPATH", "")}
    paths = [f"packages/{p}/tests" for p in PACKAGES] + ["integration_tests"]
    session.run(
        "python",
        "-m",
        "pytest",
        *paths,
        "-m",
        "gpu",
        *session.posargs,
        env=env,
        success_codes=[0, 5],
    )
