"""A small mutation tester for fzero: do the tests notice when the code is wrong?

    python tools/mutate.py fzero/scaler.py                  # every mutant of the module
    python tools/mutate.py fzero/optim.py --sample 60 --seed 0
    python tools/mutate.py fzero/layout.py --list           # list mutants, run nothing
    python tools/mutate.py fzero/optim.py --only 3f2a9c1e,0b7d4e22

Each mutant is one small change to the module's syntax tree: an arithmetic,
comparison, boolean or bitwise operator swapped, a numeric constant or boolean
changed, ``not``/unary minus/``~`` dropped, an ``if`` condition negated, a
statement replaced by ``pass``, ``torch.where``'s branches swapped, or one of
a few method/dtype names swapped (``any``/``all``, ``max``/``min``,
``float32``/``float64``, ``double``/``float``...). Docstrings, f-strings
(error messages), annotations, imports and ``__all__`` are not mutated.

The real file is never edited: the package is copied to a temporary
directory, the mutant is written there, and the module's mapped test files
(``TEST_MAP``, fast ones first) run in a fresh ``python -m pytest -x`` with
that copy first on ``PYTHONPATH``, with a timeout; the temporary directory is
removed on exit, also on Ctrl-C. An unmutated baseline run must pass first.

A mutant is *killed* when the tests fail, *timeout* when they run past the
limit (counted as detected), *survived* when they pass, and *equivalent* when
it survived and its id is listed in ``tools/mutation_equivalent.txt``
(``<module> <id> <reason>``, one per line): a change no test can observe.
Ids are hashes of the enclosing function, the original code and the change,
so they survive edits elsewhere in the file. Score:
``(killed + timeout) / (total - equivalent)``.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT_FILE = ROOT / "tools" / "mutation_equivalent.txt"

# module -> the test files that pin its behaviour, fastest first (pytest stops at the first failure).
TEST_MAP = {
    "fzero/scaler.py": ["tests/test_errors.py", "tests/test_mutation_gaps.py", "tests/test_scaler.py"],
    "fzero/optim.py": ["tests/test_errors.py", "tests/test_mutation_gaps.py", "tests/test_optim_protocol.py",
                       "tests/test_optim_compiled.py"],
    "fzero/torch_optim_rules.py": ["tests/test_torch_optim_rules.py"],
    "fzero/muon_rules.py": ["tests/test_muon.py"],
    "fzero/layout.py": ["tests/test_errors.py", "tests/test_mutation_gaps.py", "tests/test_layout.py"],
    "fzero/sharding.py": ["tests/test_errors.py", "tests/test_mutation_gaps.py", "tests/test_layout.py",
                          "tests/test_zero3.py", "tests/test_optim_compiled.py"],
    "fzero/step.py": ["tests/test_step_contracts.py", "tests/test_errors.py", "tests/test_batch_checks.py", "tests/test_step.py", "tests/test_zero3.py",
                      "tests/test_training_features.py", "tests/test_donation.py", "tests/test_user_models.py",
                      "tests/test_stage3_modules.py"],
    "fzero/units.py": ["tests/test_zero3.py", "tests/test_stage3_modules.py"],
    "fzero/buckets.py": ["tests/test_errors.py", "tests/test_overlap.py", "tests/test_param_ownership.py",
                         "tests/test_memory_census.py", "tests/test_step.py"],
}

BINOP_SWAPS = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
    ast.BitXor: ast.BitOr, ast.LShift: ast.RShift, ast.RShift: ast.LShift,
}
CMP_SWAPS = {
    ast.Eq: [ast.NotEq], ast.NotEq: [ast.Eq], ast.Lt: [ast.LtE, ast.Gt], ast.LtE: [ast.Lt, ast.GtE],
    ast.Gt: [ast.GtE, ast.Lt], ast.GtE: [ast.Gt, ast.LtE], ast.Is: [ast.IsNot], ast.IsNot: [ast.Is],
    ast.In: [ast.NotIn], ast.NotIn: [ast.In],
}
NAME_SWAPS = {
    "any": "all", "all": "any", "maximum": "minimum", "minimum": "maximum", "max": "min", "min": "max",
    "amax": "amin", "amin": "amax", "float64": "float32", "float32": "float64", "double": "float",
    "float": "double", "isfinite": "isinf", "floor": "ceil", "ceil": "floor", "sqrt": "rsqrt",
}
SKIP_CALLS = {"ValueError", "TypeError", "RuntimeError", "KeyError", "LayoutMismatchError", "NotImplementedError"}


@dataclass
class Mutant:
    index: int
    site: int
    alt: int
    line: int
    func: str
    desc: str
    original: str
    mutated: str
    key: str = ""


def _op_name(op: type) -> str:
    return op.__name__


class _Walker(ast.NodeTransformer):
    """Visits nodes in a fixed order; numbers every mutation site; applies one if asked."""

    def __init__(self, target: tuple[int, int] | None = None):
        self.target = target
        self.site = 0
        self.found: list[Mutant] = []
        self.func: list[str] = []
        self.done = False

    # -- what not to mutate -------------------------------------------------------------
    def _skip_stmt(self, node: ast.stmt) -> bool:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Pass, ast.Global, ast.Nonlocal)):
            return True
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return True  # docstring
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return True
        return False

    # -- alternatives for one node ----------------------------------------------------------
    def _alternatives(self, node: ast.AST) -> list[tuple[str, ast.AST]]:
        out: list[tuple[str, ast.AST]] = []
        if isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            out.append(("delete statement", ast.Pass()))
        if isinstance(node, (ast.If, ast.While)) and not (
            isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)
        ):  # (for ``if not x`` dropping the ``not`` is the same mutant)
            n = copy.deepcopy(node)
            n.test = ast.UnaryOp(ast.Not(), n.test)
            out.append(("negate condition", n))
        if isinstance(node, ast.IfExp):
            n = copy.deepcopy(node)
            n.body, n.orelse = n.orelse, n.body
            out.append(("swap if-expression branches", n))
        if isinstance(node, ast.BinOp) and type(node.op) in BINOP_SWAPS:
            new = BINOP_SWAPS[type(node.op)]
            n = copy.deepcopy(node)
            n.op = new()
            out.append((f"{_op_name(type(node.op))} -> {_op_name(new)}", n))
        if isinstance(node, ast.AugAssign) and type(node.op) in BINOP_SWAPS:
            new = BINOP_SWAPS[type(node.op)]
            n = copy.deepcopy(node)
            n.op = new()
            out.append((f"{_op_name(type(node.op))}= -> {_op_name(new)}=", n))
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                for new in CMP_SWAPS.get(type(op), []):
                    n = copy.deepcopy(node)
                    n.ops[i] = new()
                    out.append((f"{_op_name(type(op))} -> {_op_name(new)}", n))
        if isinstance(node, ast.BoolOp):
            n = copy.deepcopy(node)
            n.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            out.append(("and <-> or", n))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub, ast.Invert)):
            out.append((f"drop {_op_name(type(node.op))}", copy.deepcopy(node.operand)))
        if isinstance(node, ast.Constant) and not isinstance(node.value, str):
            v = node.value
            if isinstance(v, bool):
                out.append((f"{v} -> {not v}", ast.Constant(not v)))
            elif isinstance(v, int):
                out.append((f"{v} -> {v + 1}", ast.Constant(v + 1)))
            elif isinstance(v, float):
                new = 1.0 if v == 0.0 else v * 2.0
                out.append((f"{v!r} -> {new!r}", ast.Constant(new)))
            elif v is None:
                pass
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "where" and len(node.args) == 3:
                n = copy.deepcopy(node)
                n.args[1], n.args[2] = n.args[2], n.args[1]
                out.append(("swap torch.where branches", n))
        if isinstance(node, ast.Attribute) and node.attr in NAME_SWAPS:
            n = copy.deepcopy(node)
            n.attr = NAME_SWAPS[node.attr]
            out.append((f".{node.attr} -> .{n.attr}", n))
        return out

    # -- traversal --------------------------------------------------------------------------
    def visit(self, node: ast.AST) -> ast.AST:
        if self.done:
            return node
        if isinstance(node, ast.stmt) and self._skip_stmt(node):
            return node
        if isinstance(node, ast.JoinedStr):
            return node
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in SKIP_CALLS:
            return node  # the exception's message, not its raising
        alts = self._alternatives(node)
        for alt, (desc, new) in enumerate(alts):
            if self.target is None:
                self.found.append(Mutant(
                    len(self.found), self.site, alt, getattr(node, "lineno", 0), ".".join(self.func) or "<module>",
                    desc, _short(node), _short(new),
                ))
            elif self.target == (self.site, alt):
                self.done = True
                return ast.copy_location(new, node) if hasattr(node, "lineno") else new
        if alts:
            self.site += 1
        named = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        if named:
            self.func.append(node.name)
        try:
            self._children(node)
        finally:
            if named:
                self.func.pop()
        return node

    def _children(self, node: ast.AST) -> None:
        for field, value in ast.iter_fields(node):
            if field in ("annotation", "returns", "decorator_list", "type_comment"):
                continue
            if isinstance(node, ast.arguments) and field in ("defaults", "kw_defaults"):
                continue  # default arguments are API, checked by their own tests or equivalent
            if isinstance(value, list):
                new_list = []
                for item in value:
                    if isinstance(node, ast.ClassDef) and isinstance(item, ast.AnnAssign):
                        new_list.append(item)  # a dataclass field declaration: structure, not behaviour
                        continue
                    new_list.append(self.visit(item) if isinstance(item, ast.AST) else item)
                setattr(node, field, new_list)
            elif isinstance(value, ast.AST):
                setattr(node, field, self.visit(value))


def _short(node: ast.AST, limit: int = 100) -> str:
    try:
        text = ast.unparse(node)
    except Exception:  # noqa: BLE001
        text = type(node).__name__
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def enumerate_mutants(source: str) -> list[Mutant]:
    walker = _Walker()
    walker.visit(ast.parse(source))
    seen: dict[str, int] = {}
    for m in walker.found:
        base = f"{m.func}|{m.original}|{m.desc}|{m.mutated}"
        seen[base] = seen.get(base, 0) + 1
        m.key = hashlib.sha1(f"{base}|{seen[base]}".encode()).hexdigest()[:8]
    return walker.found


def mutate(source: str, m: Mutant) -> str:
    tree = ast.parse(source)
    walker = _Walker((m.site, m.alt))
    tree = walker.visit(tree)
    assert walker.done, m
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def load_equivalent(module: str) -> dict[str, str]:
    out = {}
    if EQUIVALENT_FILE.exists():
        for line in EQUIVALENT_FILE.read_text().splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split(None, 2)
            if len(parts) >= 2 and parts[0] == module:
                out[parts[1]] = parts[2] if len(parts) > 2 else ""
    return out


def _run_tests(pkg_root: Path, tests: list[str], timeout: float, extra: list[str]) -> tuple[str, float, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(pkg_root), str(ROOT / "tests")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", "-o", "addopts=",
           *extra, *[str(ROOT / t) for t in tests]]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=pkg_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = "survived" if proc.returncode == 0 else "killed"
        if proc.returncode not in (0, 1):
            status = "killed" if proc.returncode != 5 else "survived"  # 5: no tests ran
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        status = "timeout"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return status, time.monotonic() - t0, out or ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("module", help="e.g. fzero/scaler.py")
    ap.add_argument("--tests", nargs="*", help="test files (default: TEST_MAP[module])")
    ap.add_argument("--sample", type=int, default=0, help="run a deterministic sample of N mutants")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated mutant ids")
    ap.add_argument("--exclude-from", action="append", default=[],
                    help="an earlier run's output: leave out the mutants it ran (to sample further)")
    ap.add_argument("--timeout", type=float, default=0, help="seconds per mutant (default: 3x baseline + 30)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments, e.g. \"-m 'not distributed'\"")
    args = ap.parse_args(argv)

    module = args.module.replace(os.sep, "/")
    src_path = ROOT / module
    source = src_path.read_text()
    mutants = enumerate_mutants(source)
    equivalent = load_equivalent(module)
    if args.list:
        for m in mutants:
            eq = "  [equivalent]" if m.key in equivalent else ""
            print(f"{m.key}  L{m.line:<4} {m.func:<28} {m.desc:<28} {m.original}  =>  {m.mutated}{eq}")
        print(f"{len(mutants)} mutants")
        return 0
    chosen = mutants
    done: set[str] = set()
    for path in args.exclude_from:
        done |= set(re.findall(r"^\[\d+/\d+\] ([0-9a-f]{8}) ", Path(path).read_text(), re.M))
    if done:
        chosen = [m for m in mutants if m.key not in done]
    if args.only:
        keys = set(args.only.split(","))
        chosen = [m for m in mutants if m.key in keys]
    if args.sample and args.sample < len(chosen) and not args.only:
        idx = sorted(random.Random(args.seed).sample(range(len(chosen)), args.sample))
        chosen = [chosen[i] for i in idx]
    tests = args.tests or TEST_MAP.get(module)
    if not tests:
        ap.error(f"no test files mapped for {module}; pass --tests")
    extra = args.pytest_args.split() if args.pytest_args else []

    tmp = Path(tempfile.mkdtemp(prefix="fzero-mutate-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up on kill too, not only Ctrl-C
    results = []
    try:
        pkg = module.split("/")[0]
        shutil.copytree(ROOT / pkg, tmp / pkg, ignore=shutil.ignore_patterns("__pycache__"))
        target = tmp / module
        check = subprocess.run([sys.executable, "-c", f"import {pkg}; print({pkg}.__file__)"], cwd=tmp,
                               env={**os.environ, "PYTHONPATH": str(tmp)}, capture_output=True, text=True)
        if not check.stdout.strip().startswith(str(tmp)):
            print(f"the copy is not what python imports: {check.stdout or check.stderr}", file=sys.stderr)
            return 2
        print(f"{module}: {len(mutants)} mutants, running {len(chosen)} against {' '.join(tests)}", flush=True)
        status, base_s, out = _run_tests(tmp, tests, timeout=3600, extra=extra)
        if status != "survived":
            print(f"baseline (unmutated) run failed:\n{out[-3000:]}", file=sys.stderr)
            return 2
        timeout = args.timeout or 3 * base_s + 30
        print(f"baseline passes in {base_s:.0f}s; timeout per mutant {timeout:.0f}s", flush=True)
        for n, m in enumerate(chosen, 1):
            target.write_text(mutate(source, m))
            status, secs, out = _run_tests(tmp, tests, timeout, extra)
            if status == "survived" and m.key in equivalent:
                status = "equivalent"
            results.append((m, status, secs))
            print(f"[{n}/{len(chosen)}] {m.key} L{m.line} {m.desc:<26} {status:<10} {secs:5.0f}s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    counts = {k: sum(1 for _, s, _ in results if s == k) for k in ("killed", "timeout", "survived", "equivalent")}
    scored = len(results) - counts["equivalent"]
    pct = 100.0 * (counts["killed"] + counts["timeout"]) / scored if scored else 100.0
    print()
    print("| module | mutants | run | killed | timeout | survived | equivalent | killed % |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {module} | {len(mutants)} | {len(results)} | {counts['killed']} | {counts['timeout']} | "
          f"{counts['survived']} | {counts['equivalent']} | {pct:.1f} |")
    for m, s, _ in results:
        if s in ("survived", "equivalent"):
            why = f"  # equivalent: {equivalent[m.key]}" if s == "equivalent" else ""
            print(f"\n{s.upper()} {m.key}  {module}:{m.line} in {m.func}: {m.desc}{why}")
            print(f"-   {m.original}\n+   {m.mutated}")
    return 0 if counts["survived"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
