"""Every job of the pc monorepo: `nox -s tests | lint | typecheck | demo | bench | docs | gpu`.

Sessions install the local packages together, editable, so internal
dependencies (pc-zero -> pc-chunk -> pc-comm ...) resolve from this checkout.
torch is pinned through constraints/cpu.txt for CPU machines; set
PC_CONSTRAINTS=<file> to use other pins, or PC_CONSTRAINTS= (empty) for none.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import nox
import nox.command
import nox.project
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).parent
# Bottom layer first: the order tests run and packages install in. pc-booster
# is the library on top of the layers, pc-train the application on top of it.
PACKAGES = [
    "pc-comm",
    "pc-offload",
    "pc-chunk",
    "pc-zero",
    "pc-pipeline",
    "pc-tensor",
    "pc-booster",
    "pc-train",
    "pc-compat",
]
INTEGRATION = "integration"
# datasets: pc-train reads save_to_disk directories; the test of that needs it.
TEST_DEPS = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "hypothesis>=6",
    "datasets>=2.14",
    "torchao>=0.10",  # 8-bit optimizer states (pc_offload.states)
]

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
    """All packages editable in one pip call, plus ``extra`` requirements.
    pc-booster's tests boost transformers models (its ``hf`` extra);
    pc-train brings what the demo needs as plain dependencies."""
    editable: list[str] = []
    for package in PACKAGES:
        spec = f"packages/{package}[hf]" if package == "pc-booster" else f"packages/{package}"
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
    # Queued now, so it runs after this session even when a test fails.
    packages = [target for target in targets if target != INTEGRATION]
    if packages:
        session.notify("install_alone", posargs=packages)
    _install_workspace(session, *TEST_DEPS)
    for target in targets:
        path = "integration_tests" if target == INTEGRATION else f"packages/{target}/tests"
        session.log(f"--- {target}")
        # Exit code 5 means "no tests collected": a package that is still a
        # skeleton passes, and says so in the log.
        # The slowest tests are listed, so a CI log shows where the time went.
        session.run(
            "python", "-m", "pytest", path, "-m", "not gpu and not scale", "--durations=8",
            *pytest_args,
            success_codes=[0, 5],
        )  # fmt: skip


# Run by each fresh environment of `install_alone` (written to a file there):
# import the package and read every name of its __all__. Arguments:
# distribution, module.
_IMPORT_PUBLIC_NAMES = r"""
import importlib, sys, traceback
distribution, module_name = sys.argv[1:]
alone = f"{distribution}, installed alone with the pc packages it declares"
fix = f"declare what it imports in packages/{distribution}/pyproject.toml, or stop importing it"
try:
    module = importlib.import_module(module_name)
except Exception as error:
    traceback.print_exc()
    sys.exit(f"{alone}: `import {module_name}` fails with {error!r}. Fix: {fix}.")
if not module.__file__.startswith(sys.prefix):
    sys.exit(f"{alone}: {module_name} comes from {module.__file__}, not the fresh environment.")
failed = []
for name in module.__all__:
    try:
        getattr(module, name)
    except Exception as error:
        traceback.print_exc()
        failed.append(f"{module_name}.{name}: {error!r}")
if failed:
    listed = "\n  ".join(failed)
    sys.exit(f"{alone}: names of __all__ fail (if an import, {fix}):\n  {listed}")
print(f"{alone}: all {len(module.__all__)} names of {module_name}.__all__ import.")
"""


def _declared(package: str) -> list[Requirement]:
    """The `[project] dependencies` of packages/<package>/pyproject.toml."""
    pyproject = nox.project.load_toml(ROOT / "packages" / package / "pyproject.toml")
    return [Requirement(line) for line in pyproject["project"].get("dependencies", [])]


def _with_pc_dependencies(session: nox.Session, package: str) -> list[str]:
    """``package`` and the pc packages it declares, transitively, in PACKAGES order."""
    found: set[str] = set()
    pending = [package]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found.add(name)
        for requirement in _declared(name):
            dependency = canonicalize_name(requirement.name)
            if not dependency.startswith("pc-"):
                continue
            if dependency not in PACKAGES:
                session.error(
                    f"{name} declares {requirement}, but {dependency} is not a package "
                    f"of this repository; expected one of {PACKAGES}"
                )
            pending.append(dependency)
    return [name for name in PACKAGES if name in found]


def _third_party(packages: list[str]) -> list[str]:
    """The third-party requirements ``packages`` declare, sorted."""
    return sorted({str(r) for p in packages for r in _declared(p) if not r.name.startswith("pc-")})


def _third_party_site(session: nox.Session, requirements: list[str]) -> Path:
    """One directory holding ``requirements`` (torch, pinned by the
    constraints, and what it needs; pc-train's transformers, ...), installed
    once and reused while the requirements, pins and Python stay the same.
    Each set of requirements has its own directory, so a package is checked
    with the third-party packages it declares and no others (pc-booster
    without pc-train's transformers)."""
    constraints = _constraints(session)
    stamp = json.dumps(
        {
            "requirements": requirements,
            "constraints": Path(constraints[1]).read_text() if constraints else "",
            "python": sys.version,
        }
    )
    digest = hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:12]
    site = (session.cache_dir / f"install-alone-site-{digest}").resolve()
    stamp_file = site / "pc-install-alone.json"
    if stamp_file.is_file() and stamp_file.read_text() == stamp:
        session.log(f"third-party requirements {requirements} already in {site}")
        return site
    # Installed beside the old one and swapped in, so that `-R` (which skips
    # installs) keeps the old directory rather than none.
    fresh = site.with_name(site.name + ".new")
    shutil.rmtree(fresh, ignore_errors=True)
    installed = session.run_install(
        "python", "-m", "pip", "install", "--quiet", "--target", str(fresh),
        *constraints, *requirements,
    )  # fmt: skip
    if installed is None:
        session.warn(f"{site} is out of date and -R/--no-install skipped its install")
        return site
    shutil.rmtree(site, ignore_errors=True)
    fresh.rename(site)
    stamp_file.write_text(stamp)
    return site


@nox.session
def install_alone(session: nox.Session) -> None:
    """Install each package alone, with only the pc packages it declares
    (transitively), into a fresh environment, and import every name of its
    `__all__`: an undeclared or missing internal dependency fails here. Run
    by `tests`; `nox -s install_alone -- pc-zero` checks one package.

    Fast by design: the pc packages are built into wheels once and installed
    with `--no-index`, so pip finds no pc package but those passed to it, and
    the third-party requirements (torch; pc-train's transformers ...) are
    installed once per set into a shared directory that each environment
    with that set sees through a .pth file (not in 8 copies, ~20 s each)."""
    targets, _ = _split_targets(session)
    packages = [target for target in targets if target != INTEGRATION]
    closures = {package: _with_pc_dependencies(session, package) for package in packages}
    needed = [p for p in PACKAGES if any(p in closure for closure in closures.values())]
    session.install("hatchling>=1.24")
    wanted = {package: tuple(_third_party(closure)) for package, closure in closures.items()}
    sites = {reqs: _third_party_site(session, list(reqs)) for reqs in sorted(set(wanted.values()))}
    tmp = Path(session.create_tmp()).resolve()
    wheelhouse = tmp / "wheels"
    shutil.rmtree(wheelhouse, ignore_errors=True)
    built = session.run(
        "python", "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
        "--wheel-dir", str(wheelhouse), *(str(ROOT / "packages" / p) for p in needed),
    )  # fmt: skip
    if built is None:  # --install-only: the rest is the check, not an install
        return
    wheels = {p: next(wheelhouse.glob(p.replace("-", "_") + "-*.whl")) for p in needed}
    check = tmp / "import_public_names.py"
    check.write_text(_IMPORT_PUBLIC_NAMES)
    failed: list[str] = []
    for package, installed in closures.items():
        session.log(f"--- {package} alone, with {installed[:-1] or 'no pc package'}")
        env = tmp / "envs" / package
        shutil.rmtree(env, ignore_errors=True)
        session.run("python", "-m", "venv", "--without-pip", str(env))
        python = str(env / ("Scripts" if os.name == "nt" else "bin") / "python")
        purelib = session.run(
            python, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
            silent=True, external=True,
        )  # fmt: skip
        if not isinstance(purelib, str):
            raise AssertionError(f"expected the site-packages path of {python}, got {purelib!r}")
        # The third-party packages it declares (torch ...), shared by every
        # environment of this check that declares the same.
        site = sites[wanted[package]]
        (Path(purelib.strip()) / "_pc_third_party.pth").write_text(f"{site}\n")
        try:
            # --no-index: pip may take pc packages only from the wheels named
            # here, so a declared pc dependency that is missing, or out of its
            # range, fails the install.
            session.run(
                "python", "-m", "pip", "--python", python, "install", "--no-index",
                *(str(wheels[name]) for name in installed),
            )  # fmt: skip
            session.run(
                python, "-I", "-W", "ignore:Failed to initialize NumPy",
                str(check), package, package.replace("-", "_"),
                external=True,
            )  # fmt: skip
        except nox.command.CommandFailed:
            failed.append(package)
    if failed:
        session.error(
            f"{failed} fail when installed alone with the pc packages they declare; "
            "see each one's log above."
        )


@nox.session
def plugin_matrix(session: nox.Session) -> None:
    """Every plugin combination, not the sample `tests` runs: plugin (and
    hybrid's tp x pp x zero x schedule) x precision x clipping x
    accumulation x construction x model dtype, each trained against
    single-process training or refused by the plugin's rules; and the API,
    pc-train and pc-estimate agreeing on every combination pc-train can
    express. About 35 minutes on 2 cores."""
    _install_workspace(session, *TEST_DEPS)
    session.env["PC_PLUGIN_MATRIX"] = "full"
    session.run(
        "python", "-m", "pytest", "-s", "-k", "every_combination or agree",
        "packages/pc-booster/tests", "integration_tests/test_rules_agree.py", *session.posargs,
    )  # fmt: skip


@nox.session
def plans(session: nox.Session) -> None:
    """The plan sweep: every model family of the installed transformers
    that ships a tensor-parallel plan, built tiny and trained under tp 2,
    tp 2 + sequence parallelism, pp 2 (causal LM, sequence and token
    classification) and, for a sample, tp 2 x pp 2 at world 4, each
    against single-process training or refused with the reason. Rewrites
    docs/plan-sweep.md (`tests` runs a sample of it); then the same for
    the families without a plan that have a causal LM, with pc's inferred
    plan and pipeline cut (docs/plan-sweep-inferred.md); then expert
    parallelism 2 over every family with experts (docs/plan-sweep-ep.md)."""
    _install_workspace(session, *TEST_DEPS)
    session.run(
        "python", "integration_tests/plans/sweep.py", "--write", "docs/plan-sweep.md",
        *session.posargs,
    )  # fmt: skip
    # The families without a plan: pc's inferred plan and module-tree cut.
    session.run(
        "python", "integration_tests/plans/sweep.py", "--inferred",
        "--write", "docs/plan-sweep-inferred.md", *session.posargs,
    )  # fmt: skip
    # Expert parallelism over every family that has experts (docs/plan-sweep-ep.md).
    session.run(
        "python", "integration_tests/plans/sweep.py", "--all", "--modes", "ep",
        "--write", "docs/plan-sweep-ep.md", *session.posargs,
    )  # fmt: skip


@nox.session
def scale(session: nox.Session) -> None:
    """No rank holds the whole model: every plugin trains, saves and resumes
    (at another world size, under another plugin) with each rank under a
    kernel-enforced memory cap of its share of the model states
    (integration_tests/test_memory_capped.py; cgroup v1, as root). A few
    minutes on 2 cores."""
    _install_workspace(session, *TEST_DEPS)
    session.run(
        "python", "-m", "pytest", "-s", "-m", "scale", "integration_tests", *session.posargs
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


# bench_quick's pairs: each script's --quick run prints one line per pair.
QUICK_BENCHMARKS = ["bench_offload.py", "bench_ddp.py", "bench_zero.py", "bench_zero3.py"]


@nox.session
def bench_quick(session: nox.Session) -> None:
    """Paired ratios only, in a few minutes, for a change to a hot path
    before it lands: pc CPUAdamW over torch's best AdamW (25 M parameters),
    pc DDP over torch DDP, pc ZeRO-2 over ZeroRedundancyOptimizer, pc FSDP
    and GeminiDDP over FSDP2 (2 ranks, the step benchmarks' GPT-2), one line
    per pair with its target, and each step benchmark's no-communication
    floor. Arguments after `--` go to every script (`-- --iters 8`)."""
    _install_workspace(session)
    for script in QUICK_BENCHMARKS:
        session.run("python", str(ROOT / "benchmarks" / script), "--quick", *session.posargs)


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
